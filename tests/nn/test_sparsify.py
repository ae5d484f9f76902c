"""sparsify on models that share layers or parameters, and errors="skip" for layers it cannot convert.

Each conversion is checked against the model built by hand: the same structure holding the
block-sparse layer that ``from_dense`` makes of the original.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from bstrain.nn import BlockSparseConv2d, BlockSparseLinear, sparsify
from bstrain.nn.conv import sparsify_conv2d_candidates

SPARSE = {"linear": BlockSparseLinear, "conv": BlockSparseConv2d}


def _layer(kind: str) -> nn.Module:
    return nn.Linear(32, 32) if kind == "linear" else nn.Conv2d(16, 16, 3, padding=1)


def _input(kind: str) -> torch.Tensor:
    return torch.randn(3, 32) if kind == "linear" else torch.randn(2, 16, 5, 5)


def _sparse_copy(layer: nn.Module, **kw) -> nn.Module:
    """What sparsify(..., keep_weights=True) should put in place of ``layer``, made by hand."""
    return SPARSE["linear" if type(layer) is nn.Linear else "conv"].from_dense(layer, **kw)


class EncoderDecoder(nn.Module):
    def __init__(self, enc: nn.Module, dec: nn.Module):
        super().__init__()
        self.enc, self.act, self.dec = enc, nn.ReLU(), dec

    def forward(self, x):
        return self.dec(self.act(self.enc(x)))


class Stack(nn.Module):
    def __init__(self, *layers: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _shared_parent(layer):
    block = nn.Sequential(layer, nn.Tanh())
    return nn.Sequential(block, block)


# structure(layer) -> model, and every name the layer is registered under
STRUCTURES = {
    "attributes": (lambda layer: EncoderDecoder(layer, layer), ["enc", "dec"]),
    "modulelist": (lambda layer: Stack(layer, nn.ReLU(), layer), ["layers.0", "layers.2"]),
    "two_parents": (lambda layer: nn.Sequential(nn.Sequential(layer, nn.ReLU()), nn.Sequential(nn.Tanh(), layer)),
                    ["0.0", "1.1"]),
    "shared_parent": (_shared_parent, ["0.0", "1.0"]),
}
# include, given the layer's names: every name, the first only (a glob), the last only (a function)
INCLUDES = {
    "all": lambda names: "*",
    "first_name": lambda names: names[0],
    "last_name": lambda names: (lambda name, _m: name == names[-1]),
}


@pytest.mark.parametrize("include", INCLUDES)
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("kind", SPARSE)
def test_a_layer_registered_twice_becomes_one_sparse_layer_under_every_name(kind, structure, include):
    torch.manual_seed(0)
    build, names = STRUCTURES[structure]
    dense = _layer(kind)
    model = build(dense)
    bs = 16 if kind == "linear" else 8
    by_hand = build(_sparse_copy(dense, block_size=bs, density=0.5))
    replaced = sparsify(model, INCLUDES[include](names), block_size=bs, density=0.5)
    assert replaced == names, "every registration is replaced and listed"
    first, *others = [model.get_submodule(name) for name in names]
    assert isinstance(first, SPARSE[kind]) and all(other is first for other in others)
    assert sum(isinstance(m, SPARSE[kind]) for m in model.modules()) == 1, "one sparse layer, no dense left"
    x = _input(kind)
    torch.testing.assert_close(model(x), by_hand(x))
    (model(x) ** 2).sum().backward()               # one weight, its gradient gathered from both uses
    assert first.weight.grad is not None and len(list(model.parameters())) == 2


@pytest.mark.parametrize("kind", SPARSE)
def test_a_layer_registered_twice_stays_dense_when_no_name_is_chosen_and_gets_one_fresh_layout(kind):
    dense = _layer(kind)
    model = EncoderDecoder(dense, dense)
    with pytest.warns(UserWarning, match=r"replaced nothing .*include='act': expected a layer sparsify converts, "
                                         r"got 1 module\(s\) of type\(s\) ReLU"):
        assert sparsify(model, "act", block_size=8, density=0.5, errors="skip") == []
    assert model.enc is model.dec is dense
    assert sparsify(model, "dec", block_size=8, density=0.5, keep_weights=False) == ["enc", "dec"]
    assert isinstance(model.enc, SPARSE[kind]) and model.enc is model.dec


def test_sparsify_conv2d_candidates_lists_every_registration():
    conv, other = nn.Conv2d(16, 16, 1), nn.Conv2d(16, 16, 1)
    model = Stack(conv, other, conv)
    assert sparsify_conv2d_candidates(model, "layers.2", block_size=8) == [("layers.0", conv), ("layers.2", conv)]
    assert sparsify_conv2d_candidates(model, "*", block_size=8) == [("layers.0", conv), ("layers.1", other),
                                                                    ("layers.2", conv)]


# --- tied parameters ------------------------------------------------------------------------------------
def _tied_pair(kind: str, param: str) -> nn.Sequential:
    a, b = _layer(kind), _layer(kind)
    setattr(b, param, getattr(a, param))
    return nn.Sequential(a, nn.ReLU(), b)


@pytest.mark.parametrize("param", ("weight", "bias"))
@pytest.mark.parametrize("kind", SPARSE)
def test_tied_parameters_of_two_layers_are_refused_not_untied(kind, param):
    model = _tied_pair(kind, param)
    a, b = model[0], model[2]
    with pytest.raises(ValueError, match=rf"^0: expected parameters of its own, got 0\.{param} tied to 2\.{param}"):
        sparsify(model, "*", block_size=8, density=0.5)
    with pytest.raises(ValueError, match=rf"^2: expected parameters of its own, got 2\.{param} tied to 0\.{param}"):
        sparsify(model, "2", block_size=8, density=0.5)
    with pytest.warns(UserWarning, match=r"left 2 chosen layer\(s\) dense.*0: .*tied to 2\..*2: .*tied to 0\."):
        result = sparsify(model, "*", block_size=8, density=0.5, errors="skip")
    assert result == [] and list(result.skipped) == ["0", "2"]
    assert model[0] is a and model[2] is b and getattr(a, param) is getattr(b, param), "still dense and tied"


class TiedLM(nn.Module):
    """A language model whose head shares the embedding's weight, and a free body layer."""

    def __init__(self):
        super().__init__()
        self.embed, self.body = nn.Embedding(64, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.relu(self.body(self.embed(tokens))))


class ParentHeldWeight(nn.Module):
    """A layer whose weight its parent also registers (and reads) as a parameter of its own."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(32, 32), nn.Linear(32, 32)
        self.scale = self.head.weight

    def forward(self, x):
        return self.head(torch.relu(self.body(x))) + x @ self.scale


@pytest.mark.parametrize("model_class, tied", [(TiedLM, "embed.weight"), (ParentHeldWeight, "scale")],
                         ids=["embedding", "parent_parameter"])
def test_a_layer_tied_to_a_module_that_is_not_converted_is_refused_or_skipped(model_class, tied):
    torch.manual_seed(0)
    model = model_class()
    x = torch.randint(0, 64, (3, 5)) if model_class is TiedLM else torch.randn(3, 32)
    with pytest.raises(ValueError, match=rf"^head: expected parameters of its own, got head\.weight tied to {tied}"):
        sparsify(model, "*", block_size=16, density=0.5)
    assert type(model.body) is nn.Linear, "nothing is replaced when a chosen layer cannot be"
    by_hand = model_class()
    by_hand.load_state_dict(model.state_dict())
    by_hand.body = _sparse_copy(by_hand.body, block_size=16, density=0.5)
    with pytest.warns(UserWarning, match=rf"head: .*tied to {tied}"):
        result = sparsify(model, "*", block_size=16, density=0.5, errors="skip")
    assert result == ["body"] and list(result.skipped) == ["head"] and "untie" in result.skipped["head"]
    assert model.head.weight is model.get_parameter(tied), "still tied"
    torch.testing.assert_close(model(x), by_hand(x))


# --- layers that cannot be converted --------------------------------------------------------------------
def _convnet() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                         nn.Conv2d(16, 16, 1, groups=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))


def test_errors_skip_leaves_what_cannot_be_converted_dense_and_says_why():
    torch.manual_seed(0)
    model = _convnet()
    by_hand = _convnet()
    by_hand.load_state_dict(model.state_dict())
    by_hand[2] = _sparse_copy(by_hand[2], block_size=16, density=0.5)
    by_hand[6] = _sparse_copy(by_hand[6], block_size=16, density=0.5)
    with pytest.warns(UserWarning) as record:
        result = sparsify(model, "*", block_size=16, density=0.5, errors="skip")
    assert result == ["2", "6"] and repr(result) == "['2', '6']" and isinstance(result, list)
    assert result.skipped == {
        "0": "0: expected in/out channels that are multiples of block_size=16, got 3 and 16",
        "3": "3: expected groups=1 (a grouped conv is a block-diagonal layout: build a BlockSparseConv2d with "
             "layout=...), got groups=2",
        "8": "8: expected in/out features that are multiples of block_size=16, got 32 and 10"}
    assert len(record) == 1 and all(why in str(record[0].message) for why in result.skipped.values())
    assert [type(model[i]) for i in (0, 3, 8)] == [nn.Conv2d, nn.Conv2d, nn.Linear]
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(model(x), by_hand(x))


def test_errors_raise_is_the_default_and_names_the_layer():
    model = _convnet()
    with pytest.raises(ValueError, match=r"^0: expected in/out channels that are multiples of block_size=16, "
                                         r"got 3 and 16$"):
        sparsify(model, "*", block_size=16, density=0.5)
    with pytest.raises(ValueError, match=r"^8: expected in/out features that are multiples of block_size=16, "
                                         r"got 32 and 10$"):
        sparsify(model, "[5-9]", block_size=16, density=0.5, errors="raise")
    assert type(model[2]) is nn.Conv2d and type(model[6]) is nn.Linear, "nothing is replaced"
    odd = nn.Linear(30, 30)
    shared = EncoderDecoder(odd, odd)
    with pytest.raises(ValueError, match=r"^enc \(also dec\): expected in/out features"):
        sparsify(shared, "dec", block_size=16, density=0.5)
    with pytest.warns(UserWarning, match=r"enc \(also dec\)"):
        result = sparsify(shared, "dec", block_size=16, density=0.5, errors="skip")
    assert result == [] and list(result.skipped) == ["enc", "dec"] and shared.enc is shared.dec is odd


def test_the_result_is_the_list_of_names_when_nothing_is_skipped():
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # nothing skipped: no warning
        result = sparsify(mlp, "*", block_size=32, density=0.25, errors="skip")
    assert str(result) == "['0', '2']" and result == ["0", "2"] and result.skipped == {}


@pytest.mark.parametrize("kwargs, error, match", [
    ({"errors": "ignore"}, ValueError, r"^errors: expected 'raise' or 'skip', got 'ignore'"),
    ({"include": 3}, TypeError, r"^include: expected a glob \(str\) or a function"),
    ({"block_size": 0}, ValueError, r"^block_size: expected a positive int, got 0"),
    ({"block_size": 4, "errors": "skip"}, ValueError, r"^block_size: expected one of"),
    ({"density": 2.0, "errors": "skip"}, ValueError, r"^density: expected a value in \(0, 1\]"),
], ids=["errors", "include", "block_size_zero", "block_size_for_linear", "density"])
def test_bad_arguments_are_refused_before_any_layer_is_replaced(kwargs, error, match):
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    args = {"include": "*", "block_size": 16, "density": 0.5, **kwargs}
    with pytest.raises(error, match=match):
        sparsify(mlp, args.pop("include"), **args)
    assert type(mlp[0]) is nn.Linear and type(mlp[2]) is nn.Linear
