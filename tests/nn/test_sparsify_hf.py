"""sparsify on Hugging Face and timm models built from tiny random configs: GPT-2's Conv1D layers,
a glob or function that chooses nothing, a user's own layer type, dynamic sparsity on GPT-2, and
the save_pretrained / bstrain.hf.from_pretrained round trip."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="the Hugging Face cases need transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

import bstrain  # noqa: E402
import bstrain.hf  # noqa: E402
from bstrain.nn import BlockSparseLinear, block_sparse_layouts, register_sparsifiable, sparsify  # noqa: E402
from bstrain.nn.convert import _REGISTRY  # noqa: E402
from bstrain.sparsity import RigL  # noqa: E402

VOCAB = 128
TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def gpt2():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, **TOKENS)
    return transformers.GPT2LMHeadModel(cfg), "transformer.h.*"


def llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, **TOKENS)
    return transformers.LlamaForCausalLM(cfg), "model.layers.*"


def bert():
    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=VOCAB, max_position_embeddings=32, pad_token_id=0)
    return transformers.BertForMaskedLM(cfg), "bert.encoder.*"


def vit():
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, num_labels=10)
    return transformers.ViTForImageClassification(cfg)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def tokens(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


# --- GPT-2's Conv1D ---------------------------------------------------------------------------------
def test_gpt2_conv1d_layers_are_converted_and_compute_as_the_dense_model_at_density_1():
    model, glob = gpt2()
    model.eval()
    x = tokens()
    dense = model(x).logits
    replaced = sparsify(model, glob, block_size=16, density=1.0)
    assert replaced == [f"transformer.h.{i}.{layer}" for i in range(2)
                        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert all(isinstance(model.get_submodule(n), BlockSparseLinear) for n in replaced)
    torch.testing.assert_close(model(x).logits, dense, rtol=0, atol=1e-5)    # fp32 rounding: another sum order


def test_a_function_include_is_asked_about_conv1d_layers():
    model, _ = gpt2()
    asked = []
    replaced = sparsify(model, lambda name, layer: asked.append(type(layer).__name__) or name.endswith("mlp.c_fc"),
                        block_size=16, density=0.5)
    assert replaced == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"] and "Conv1D" in asked


def test_from_dense_reads_conv1d_weight_transposed_and_to_dense_gives_an_equal_linear():
    torch.manual_seed(0)
    conv1d = Conv1D(48, 32)                                   # nf=48 outputs, nx=32 inputs: weight (32, 48)
    conv1d.bias.data.normal_()
    x = torch.randn(5, 7, 32, dtype=torch.float64)
    expected = x @ conv1d.weight.double() + conv1d.bias.double()                       # (5, 7, 48)
    layer = BlockSparseLinear.from_dense(conv1d, block_size=16, density=1.0)
    torch.testing.assert_close(layer(x.float()).double(), expected, rtol=0, atol=1e-5)
    dense = layer.to_dense()
    assert type(dense) is nn.Linear and torch.equal(dense.weight, conv1d.weight.t()) and torch.equal(dense.bias,
                                                                                                      conv1d.bias)
    pruned = BlockSparseLinear.from_dense(conv1d, block_size=16, density=0.5)
    norms = conv1d.weight.detach().reshape(2, 16, 3, 16).square().sum((1, 3))          # (C/bs, K/bs)
    assert pruned.op.layout.sum() == 3 and norms[torch.as_tensor(pruned.op.layout)].min() >= \
        norms[~torch.as_tensor(pruned.op.layout)].max()


def test_no_bstrain_module_imports_transformers_at_import_time():
    """Only inside functions: ``import bstrain`` must work, and stay fast, without transformers."""
    top_level = []
    for path in sorted(Path(bstrain.__file__).parent.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:        # module-level statements only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            top_level += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("transformers", "timm")]
    assert top_level == []


# --- an include that chooses nothing ----------------------------------------------------------------
def test_a_glob_matching_no_module_is_an_error_naming_the_closest_names():
    model = vit()
    with pytest.raises(ValueError, match=r"^include='vit\.encoder\.layer\.\*': expected a glob matching module "
                                         r"names of ViTForImageClassification, it matches none; the closest are "
                                         r"'vit\.layers\.\d"):
        sparsify(model, "vit.encoder.layer.*", block_size=16, density=0.5)
    with pytest.warns(UserWarning, match=r"replaced nothing \(errors='skip'\): include='vit\.encoder\.layer\.\*'"):
        assert sparsify(model, "vit.encoder.layer.*", block_size=16, density=0.5, errors="skip") == []
    assert sparsify(model, "vit.layers.*", block_size=16, density=0.5)[0] == "vit.layers.0.attention.q_proj"


def test_a_glob_matching_only_modules_of_other_types_names_them_and_how_to_register():
    model, _ = gpt2()
    with pytest.raises(ValueError, match=r"^include='transformer\.h\.0\.mlp': expected a layer sparsify converts, "
                                         r"got 1 module\(s\) of type\(s\) GPT2MLP \(to reach the layers inside them, "
                                         r"try 'transformer\.h\.0\.mlp\.\*'\); to convert a type of your own, call "
                                         r"bstrain\.nn\.register_sparsifiable\(GPT2MLP, to_sparse=\.\.\.\)$"):
        sparsify(model, "transformer.h.0.mlp", block_size=16, density=0.5)
    with pytest.raises(ValueError, match=r"^include=<lambda>: .*module\(s\) of type\(s\) LayerNorm"):
        sparsify(model, lambda name, layer: isinstance(layer, nn.LayerNorm), block_size=16, density=0.5)


class MaskedLinear(nn.Module):
    """A user's own layer: nn.Linear's (out, in) weight, no bias."""

    def __init__(self, c: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, c))

    def forward(self, x):
        return x @ self.weight.t()


def _masked_to_sparse(layer, *, block_size, density, keep_weights, balanced):
    sparse = BlockSparseLinear(layer.weight.shape[1], layer.weight.shape[0], bias=False, block_size=block_size,
                               density=density, balanced=balanced)
    with torch.no_grad():
        sparse.weight.copy_(sparse.op.from_dense(layer.weight.t()))
    return sparse


@pytest.fixture
def registered_masked_linear():
    register_sparsifiable(MaskedLinear, to_sparse=_masked_to_sparse)
    yield
    del _REGISTRY[MaskedLinear]


def test_an_unregistered_layer_type_is_named_with_how_to_register_it():
    model = nn.Sequential(MaskedLinear(32, 32))
    with pytest.raises(ValueError, match=r"type\(s\) MaskedLinear; .*register_sparsifiable\(MaskedLinear, "):
        sparsify(model, "*", block_size=16, density=0.5)


def test_a_registered_layer_type_is_converted(registered_masked_linear):
    model = nn.Sequential(MaskedLinear(32, 32), nn.ReLU())
    x = torch.randn(4, 32)
    dense = model(x)
    assert sparsify(model, "*", block_size=16, density=1.0) == ["0"]
    assert isinstance(model[0], BlockSparseLinear)
    torch.testing.assert_close(model(x), dense, rtol=0, atol=1e-5)


# --- dynamic sparsity on GPT-2 ----------------------------------------------------------------------
def test_rigl_moves_the_blocks_of_a_sparsified_gpt2_which_still_trains():
    torch.manual_seed(0)
    model, glob = gpt2()
    sparsify(model, glob, block_size=16, density=0.5)
    before = {name: layout.copy() for name, layout in block_sparse_layouts(model)}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    policy = RigL(model, opt, every=2, fraction=0.3)
    x = tokens(4, 16)
    losses = []
    for _ in range(6):
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        policy.step()
        losses.append(loss.item())
    after = dict(block_sparse_layouts(model))
    assert len(policy.history) == 3
    assert all(after[name].sum() == before[name].sum() for name in before)
    assert any(not np.array_equal(after[name], before[name]) for name in before), "RigL moved no block"
    assert losses[-1] < 0.8 * losses[0], losses


# --- save_pretrained / bstrain.hf.from_pretrained ---------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_a_sparsified_model_saved_by_save_pretrained_loads_back_exactly(name, tmp_path):
    torch.manual_seed(0)
    model, glob = MODELS[name]()
    replaced = sparsify(model, glob, block_size=16, density=0.5)
    model.eval()
    x = tokens()
    logits = model(x).logits
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["bstrain_sparsify"]
    assert record == [{"replaced": list(replaced), "block_size": 16, "density": 0.5, "balanced": True}]
    torch.manual_seed(1)                                                     # other fresh layouts: the saved ones win
    loaded = bstrain.hf.from_pretrained(type(model), tmp_path)
    assert torch.equal(loaded(x).logits, logits)
    saved = dict(block_sparse_layouts(model))
    assert {n: l.tolist() for n, l in block_sparse_layouts(loaded)} == {n: l.tolist() for n, l in saved.items()}
    assert loaded.config.bstrain_sparsify == model.config.bstrain_sparsify
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    if name == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight, "the head stays tied to the embedding"


def test_a_base_model_sparsified_on_its_own_loads_back_with_its_head(tmp_path):
    """sparsify(gpt2.transformer, ...) records names under the base model (h.0.attn.c_attn): the
    loader finds them under base_model_prefix, and the whole model loads back exactly."""
    model, _ = gpt2()
    model.eval()
    replaced = sparsify(model.transformer, "h.*", block_size=16, density=0.5)
    assert replaced and all(n.startswith("h.") for n in replaced)
    model.save_pretrained(tmp_path)
    loaded = bstrain.hf.from_pretrained(type(model), tmp_path)
    assert torch.equal(loaded(tokens()).logits, model(tokens()).logits)


def test_from_pretrained_of_a_dense_model_loads_it_as_it_is(tmp_path):
    model, _ = llama()
    model.eval()
    model.save_pretrained(tmp_path)
    loaded = bstrain.hf.from_pretrained(type(model), tmp_path)
    assert torch.equal(loaded(tokens()).logits, model(tokens()).logits)


# --- timm -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, glob", [("resnet18", "layer*.*.conv2"), ("vit_tiny_patch16_224", "blocks.*.mlp.*")])
def test_timm_models_are_sparsified(arch, glob):
    try:
        import timm
    except Exception as exc:            # noqa: BLE001 (timm fails to import with a broken torchvision, not only when absent)
        pytest.skip(f"timm does not import here: {exc}")
    model = timm.create_model(arch, pretrained=False, num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64) if arch.startswith("resnet") else torch.randn(1, 3, 224, 224)
    dense = model(x)
    assert sparsify(model, glob, block_size=16, density=1.0)
    torch.testing.assert_close(model(x), dense, rtol=0, atol=1e-4)
