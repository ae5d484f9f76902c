"""Config schemas: one dataclass per section, registered in Hydra's ConfigStore.

Every key a YAML file or a ``key=value`` override may set is declared here, with its type, so a
misspelled key or a wrong type fails at start with Hydra's one-line message naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ModelConfig:
    name: str = field(default="lstm", metadata={"help": "model family: lstm (multiplicative LSTM)"})
    hidden: int = field(default=256, metadata={"help": "hidden units H"})
    embed: int = field(default=64, metadata={"help": "byte embedding width"})
    depth: int = field(default=2, metadata={"help": "internal steps per timestep (deep updates), >= 1"})
    sparse: bool = field(default=True, metadata={"help": "block-sparse recurrent weights; false: dense nn.Linear"})
    block_size: int = field(default=32, metadata={"help": "block size of the sparse weights: 8-128"})
    density: float = field(default=0.4, metadata={"help": "target fraction of live blocks"})
    layout: str = field(default="barabasi_albert", metadata={"help": "barabasi_albert | watts_strogatz | random"})
    layout_seed: int = field(default=0, metadata={"help": "seed of the layouts"})
    layer_norm: bool = field(default=True, metadata={"help": "layer norm after each recurrent matmul"})
    init: str = field(default="identity", metadata={"help": "identity | uniform: init of square recurrent weights"})


@dataclass
class DataConfig:
    path: Optional[str] = field(default=None, metadata={"help": "text/binary file, enwik8(.zip), text8(.zip); "
                                                                  "null: the embedded default corpus"})
    name: str = field(default="auto", metadata={"help": "auto | bytes | enwik8 | text8"})
    seq_len: int = field(default=64, metadata={"help": "BPTT length T"})
    batch_size: int = field(default=32, metadata={"help": "parallel streams B"})


@dataclass
class OptimConfig:
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on matrices"})
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = field(default=20, metadata={"help": "linear warmup steps"})
    schedule: str = field(default="cosine", metadata={"help": "cosine | linear | constant decay after warmup"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr as a fraction of lr"})
    grad_clip: float = field(default=1.0, metadata={"help": "global-norm clip; 0 disables"})
    ema: float = field(default=0.0, metadata={"help": "EMA decay of the weights used for eval; 0 disables"})


@dataclass
class TrainerConfig:
    max_steps: int = field(default=300, metadata={"help": "optimizer steps"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    precision: str = field(default="fp32", metadata={"help": "fp32 | fp16 (dynamic loss scaling) | bf16"})
    group_size: int = field(default=8, metadata={"help": "timesteps per grouped dW launch; 1 disables"})
    resume: str = field(default="false", metadata={"help": "false | true (latest in this run dir) | PATH"})
    log_every: int = field(default=10, metadata={"help": "steps between logged scalars"})
    eval_every: int = field(default=100, metadata={"help": "steps between validations; 0: only at the end"})
    eval_batches: int = field(default=8, metadata={"help": "validation batches per evaluation"})
    ckpt_every: int = field(default=100, metadata={"help": "steps between checkpoints; 0: only at the end"})
    keep_ckpts: int = field(default=3, metadata={"help": "checkpoints kept in the run dir"})
    seed: int = field(default=0, metadata={"help": "torch seed"})
    loss_scale_window: int = field(default=200, metadata={"help": "fp16: clean steps before the scale doubles"})
    time_limit_s: float = field(default=0.0, metadata={"help": "stop (eval + checkpoint) after this many "
                                                                "seconds of training; 0: no limit"})
    run_dir: Optional[str] = field(default=None, metadata={"help": "null: Hydra's run dir (runs/DATE/TIME)"})
    progress: bool = field(default=True, metadata={"help": "tqdm bar when stderr is a terminal"})
    cuda_graph: bool = field(default=False, metadata={"help": "capture each training step in a CUDA graph "
                                                               "(CUDA, fp32/bf16, one process)"})


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@dataclass
class EvalConfig:
    ckpt: str = field(default="???", metadata={"help": "checkpoint file or run dir"})
    split: str = field(default="valid", metadata={"help": "valid | test"})
    device: str = "auto"
    batches: int = field(default=0, metadata={"help": "0: the whole split"})
    data_path: Optional[str] = field(default=None, metadata={"help": "override the checkpoint's data.path"})


@dataclass
class SampleConfig:
    ckpt: str = field(default="???", metadata={"help": "checkpoint file or run dir"})
    prompt: str = "def "
    length: int = 200
    temperature: float = 0.8
    seed: int = 0
    device: str = "auto"


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    cs.store(name="base_eval", node=EvalConfig)
    cs.store(name="base_sample", node=SampleConfig)
