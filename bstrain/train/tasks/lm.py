"""Byte-level language modelling: bits per byte, carried state for stateful models, sampling."""
from __future__ import annotations

import logging

import torch

from bstrain.data.text import BpttBatches, ByteCorpus, bits_per_byte, check_size
from bstrain.errors import UserError
from bstrain.ops.cross_entropy import cross_entropy
from bstrain.train.tasks import Forward, Task, eval_progress, model_key, rows

log = logging.getLogger("bstrain")


class ByteLM(Task):
    """Next-byte prediction on a :class:`bstrain.data.text.ByteCorpus`.

    The model maps (B, T) int64 bytes to (B, T, 256) logits. Batches are contiguous streams
    (:class:`BpttBatches`), so a stateful model's state stays valid from one batch to the next;
    a stateless model sees each (B, T) window on its own. Metrics: ``loss`` (nats per byte) and
    ``bpb`` (bits per byte, the enwik8 metric).

    Args:
        context: bytes of context a stateless model gets when sampling (0: data.seq_len).
    """

    metric = "bpb"
    unit = "tokens"                # a token is a byte

    def __init__(self, context: int = 0):
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise UserError(f"task.context: expected an int >= 0, got {context!r}")
        self.context = context
        self.data: ByteCorpus | None = None
        self.batches: BpttBatches | None = None
        self.world = None

    def setup(self, data, world, seed: int) -> None:
        if not isinstance(data, ByteCorpus):
            raise UserError(f"data: the byte LM task needs a ByteCorpus (data=bytes), got {type(data).__name__}")
        self.data, self.world = data, world
        train, valid, _ = data.splits()
        check_size(train, data.batch_size, data.seq_len, data.path, "train", world.size)
        check_size(valid, data.batch_size, data.seq_len, data.path, "valid", world.size)
        self.batches = BpttBatches(train, data.batch_size, data.seq_len, world.rank, world.size)
        self.context = self.context or data.seq_len

    def describe(self) -> str:
        return f"byte LM on {self.data.describe()}"

    def check_model_config(self, model: dict) -> None:
        """The model's vocabulary (256 byte values) and context (at least data.seq_len), where it names them."""
        if (key := model_key(model, ("vocab_size", "vocab", "n_vocab", "num_embeddings"))) and key[1] != 256:
            raise UserError(f"model.{key[0]}={key[1]}, but the byte LM's vocabulary is the 256 byte values: "
                            f"set model.{key[0]}=256")
        seq_len = self.data.seq_len
        names = ("context", "max_seq_len", "n_ctx", "n_positions", "max_position_embeddings")
        if (key := model_key(model, names)) and key[1] < seq_len:
            raise UserError(f"model.{key[0]}={key[1]}, but the model reads data.seq_len={seq_len} bytes at a time: "
                            f"set model.{key[0]} to at least {seq_len}, or data.seq_len to at most {key[1]}")

    def units_per_batch(self) -> int:
        return self.data.batch_size * self.data.seq_len

    def next_batch(self, device: torch.device):
        x, y, wrapped = self.batches.next_batch()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True), wrapped

    def loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        logits = output
        if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != targets.shape or logits.shape[-1] != 256:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TypeError(f"model output: expected (B, T, 256) logits for (B, T) = {tuple(targets.shape)} bytes, "
                            f"got {got}")
        # fused on CUDA: the logits are read in their own dtype, never copied to fp32 (targets are bytes)
        return cross_entropy(logits, targets).mean()

    def train_metrics(self, loss: float) -> dict:
        return {"bpb": bits_per_byte(loss)}

    @torch.no_grad()
    def evaluation_sums(self, forward: Forward, split: str, max_batches: int, rank: int = 0, size: int = 1,
                        show_progress: bool = False) -> dict[str, torch.Tensor]:
        """The summed loss and the bytes of rows ``rank`` of ``size`` of the first ``max_batches``
        (0: all) batches of a split, in batches of the world's global shape. Each row is a stream
        the carried state follows through the batches, so a share of rows is exact."""
        _, valid, test = self.data.splits()
        data = {"valid": valid, "test": test}[split]
        ranks = self.world.size if self.world else 1
        check_size(data, self.data.batch_size, self.data.seq_len, self.data.path, split, ranks)
        batches = BpttBatches(data, self.data.batch_size * ranks, self.data.seq_len)
        n = len(batches) if max_batches <= 0 else min(max_batches, len(batches))
        device = forward.device
        state, total, count = None, torch.zeros((), dtype=torch.float64, device=device), 0
        for i in eval_progress(n, show_progress, f"eval {split}"):
            x, y = (rows(t, rank, size) for t in batches.batch(i))
            output, state = forward(x.to(device), state)
            total += self.loss(output, y.to(device)).double() * y.numel()
            count += y.numel()
        return {"loss": total, "count": torch.tensor(float(count), dtype=torch.float64, device=device),
                "batches": torch.tensor(float(n), dtype=torch.float64, device=device) / size}

    def evaluation_metrics(self, sums: dict[str, torch.Tensor]) -> dict:
        """Mean loss and bits per byte."""
        loss = float(sums["loss"]) / max(1.0, float(sums["count"]))
        return {"loss": loss, "bpb": bits_per_byte(loss), "batches": round(float(sums["batches"]))}

    def state_dict(self) -> dict:
        return {"batches": self.batches.state_dict(), "streams": self.data.batch_size * self.world.size,
                "seq_len": self.data.seq_len}

    def load_state_dict(self, state: dict, world) -> None:
        """The same stream count and seq_len continue exactly; otherwise the epoch continues at the
        same fraction, and a carried model state (which belongs to other bytes) starts fresh."""
        streams = self.data.batch_size * world.size
        old = (state.get("streams", streams), state.get("seq_len", self.data.seq_len))
        if old != (streams, self.data.seq_len):
            log.warning("data: the checkpoint read %s streams of %s bytes, this run reads %d of %d (data.batch_size "
                        "x ranks, data.seq_len): continuing at the same fraction of the epoch with a fresh carried "
                        "state", *old, streams, self.data.seq_len)
            self.state_continues = False
        self.batches.load_state_dict(state["batches"])

    def hparams(self) -> dict:
        return {"seq_len": self.data.seq_len, "batch_size": self.data.batch_size}

    @torch.no_grad()
    def sample(self, forward: Forward, stateful: bool, prompt: bytes, length: int, temperature: float,
               generator: torch.Generator, device: torch.device) -> bytes:
        """``length`` bytes after ``prompt``. A stateful model reads the prompt once and then one byte
        per step with its state; a stateless one gets the last ``context`` bytes at every step."""
        out = bytearray(prompt or b"\n")
        x = torch.tensor([list(out[-self.context:] if not stateful else out)], device=device)
        logits, state = forward(x, None)
        for _ in range(length):
            probs = torch.softmax(logits[0, -1].float() / max(temperature, 1e-5), dim=-1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=generator))
            out.append(nxt)
            if stateful:
                logits, state = forward(torch.tensor([[nxt]], device=device), state)
            else:
                logits, _ = forward(torch.tensor([list(out[-self.context:])], device=device), None)
        return bytes(out)

