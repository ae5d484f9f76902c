"""Language modelling on bytes or tokens: bits per byte, carried state for stateful models, sampling."""
from __future__ import annotations

import logging
import math

import torch

from bstrain.data.text import BpttBatches, ByteCorpus, bits_per_byte, check_size
from bstrain.errors import UserError
from bstrain.ops.cross_entropy import cross_entropy
from bstrain.train.tasks import Forward, Task, eval_progress, model_key, rows

log = logging.getLogger("bstrain")


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or a Hugging Face ``ModelOutput``'s ``.logits``."""
    return output if isinstance(output, torch.Tensor) else getattr(output, "logits", output)


def _model_key(model: dict, names: tuple[str, ...]) -> tuple[str, int] | None:
    """(dotted key, value) of the first of ``names`` that the model section sets, at its top level
    or in its nested ``config`` (``model.config.vocab_size``)."""
    for where, node in (("model", model), ("model.config", model.get("config"))):
        if isinstance(node, dict) and (key := model_key(node, names)):
            return f"{where}.{key[0]}", key[1]
    return None


def _bytes_of(ids, lengths, chunk: int = 1 << 24) -> int:
    """UTF-8 bytes that (n,) token ids (a memory map, read in chunks) stand for."""
    return sum(int(lengths[ids[i:i + chunk]].sum()) for i in range(0, len(ids), chunk))


class ByteLM(Task):
    """Next-byte (or next-token) prediction on a :class:`bstrain.data.text.ByteCorpus`.

    The model maps (B, T) int64 bytes to (B, T, 256) logits (a tensor, or a Hugging Face
    ``ModelOutput`` with ``.logits``); on tokens (``data.tokenizer``), (B, T) token ids to (B, T, V)
    logits, V at least the tokenizer's vocabulary. Batches are contiguous streams
    (:class:`BpttBatches`), so a stateful model's state stays valid from one batch to the next;
    a stateless model sees each (B, T) window on its own. Metrics: ``loss`` (nats per byte, or per
    token) and ``bpb`` (bits per byte, the enwik8 metric, whatever the tokenizer: evaluation divides
    the nats of the targets by ln 2 times the UTF-8 bytes they stand for); on tokens also
    ``loss_per_token``. Training's logged ``bpb`` on tokens uses the train split's mean bytes per token.

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
        self.bytes_per_token = 1.0         # of the train split: training's bpb on tokens

    def setup(self, data, world, seed: int) -> None:
        if not isinstance(data, ByteCorpus):
            raise UserError(f"data: the byte LM task needs a ByteCorpus (data=bytes), got {type(data).__name__}")
        self.data, self.world = data, world
        train, valid, _ = data.splits()
        check_size(train, data.batch_size, data.seq_len, data.path, "train", world.size, data.unit)
        check_size(valid, data.batch_size, data.seq_len, data.path, "valid", world.size, data.unit)
        self.batches = BpttBatches(train, data.batch_size, data.seq_len, world.rank, world.size)
        self.context = self.context or data.seq_len
        if data.byte_lengths is not None:
            self.bytes_per_token = _bytes_of(train, data.byte_lengths) / len(train)

    def describe(self) -> str:
        return f"{'byte' if self.data.byte_lengths is None else 'token'} LM on {self.data.describe()}"

    def check_model_config(self, model: dict) -> None:
        """The model's vocabulary (the 256 byte values; on tokens at least the tokenizer's) and context
        (at least data.seq_len), where it names them: at its top level or in a nested ``config``
        (a Hugging Face model's ``config: {_target_: ...Config}``)."""
        names = ("vocab_size", "vocab", "n_vocab", "num_embeddings")
        if (key := _model_key(model, names)) and self.data.byte_lengths is None and key[1] != 256:
            raise UserError(f"{key[0]}={key[1]}, but the byte LM's vocabulary is the 256 byte values: "
                            f"set {key[0]}=256")
        if key and self.data.byte_lengths is not None and key[1] < self.data.vocab_size:
            raise UserError(f"{key[0]}={key[1]} is smaller than the vocabulary of data.tokenizer="
                            f"{self.data.tokenizer_name} ({self.data.vocab_size} tokens): set {key[0]} to at least "
                            f"{self.data.vocab_size} (e.g. ${{data.vocab_size}})")
        seq_len, unit = self.data.seq_len, self.data.unit
        names = ("context", "max_seq_len", "n_ctx", "n_positions", "max_position_embeddings")
        if (key := _model_key(model, names)) and key[1] < seq_len:
            raise UserError(f"{key[0]}={key[1]}, but the model reads data.seq_len={seq_len} {unit} at a time: "
                            f"set {key[0]} to at least {seq_len}, or data.seq_len to at most {key[1]}")

    def units_per_batch(self) -> int:
        return self.data.batch_size * self.data.seq_len

    def next_batch(self, device: torch.device):
        x, y, wrapped = self.batches.next_batch()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True), wrapped

    def _losses(self, output, targets: torch.Tensor) -> torch.Tensor:
        """(B, T) nats of each target, from the model's output (checked: (B, T, V) logits)."""
        logits, vocab = logits_of(output), self.data.vocab_size
        tokens = self.data.byte_lengths is not None
        if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != targets.shape or (
                logits.shape[-1] < vocab if tokens else logits.shape[-1] != 256):
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            want = f"(B, T, V >= {vocab}) logits for (B, T) = {tuple(targets.shape)} tokens" if tokens else \
                f"(B, T, 256) logits for (B, T) = {tuple(targets.shape)} bytes"
            raise TypeError(f"model output: expected {want}, got {got}")
        # fused on CUDA: the logits are read in their own dtype, never copied to fp32
        return cross_entropy(logits, targets)

    def loss(self, output, targets: torch.Tensor) -> torch.Tensor:
        return self._losses(output, targets).mean()

    def train_metrics(self, loss: float) -> dict:
        if self.data.byte_lengths is None:
            return {"bpb": bits_per_byte(loss)}
        return {"bpb": bits_per_byte(loss) / self.bytes_per_token, "loss_per_token": loss}

    @torch.no_grad()
    def evaluation_sums(self, forward: Forward, split: str, max_batches: int, rank: int = 0, size: int = 1,
                        show_progress: bool = False) -> dict[str, torch.Tensor]:
        """The nats summed over the targets, the targets and the UTF-8 bytes they stand for (token
        data: the tokenizer's per-token byte lengths; bytes: one each), in float64, over rows
        ``rank`` of ``size`` of the first ``max_batches`` (0: all) batches of a split, in batches of
        the world's global shape. Each row is a stream the carried state follows through the
        batches, so a share of rows is exact."""
        _, valid, test = self.data.splits()
        data = {"valid": valid, "test": test}[split]
        ranks = self.world.size if self.world else 1
        check_size(data, self.data.batch_size, self.data.seq_len, self.data.path, split, ranks, self.data.unit)
        batches = BpttBatches(data, self.data.batch_size * ranks, self.data.seq_len)
        n = len(batches) if max_batches <= 0 else min(max_batches, len(batches))
        device = forward.device
        lengths = None if self.data.byte_lengths is None else torch.from_numpy(self.data.byte_lengths).to(device)
        state, sums = None, torch.zeros(3, dtype=torch.float64, device=device)     # nats, targets, bytes
        for i in eval_progress(n, show_progress, f"eval {split}"):
            x, y = (rows(t, rank, size) for t in batches.batch(i))
            y = y.to(device)
            output, state = forward(x.to(device), state)
            count = torch.tensor(float(y.numel()), dtype=torch.float64, device=device)
            n_bytes = count if lengths is None else lengths[y].sum().double()
            sums += torch.stack([self._losses(output, y).double().sum(), count, n_bytes])
        return {"sums": sums, "batches": torch.tensor(float(n), dtype=torch.float64, device=device) / size}

    def evaluation_metrics(self, sums: dict[str, torch.Tensor]) -> dict:
        """Mean loss (per token) and bits per byte."""
        nats, targets, n_bytes = sums["sums"].tolist()
        loss, batches = nats / max(1.0, targets), round(float(sums["batches"]))
        if self.data.byte_lengths is None:
            return {"loss": loss, "bpb": bits_per_byte(loss), "batches": batches}
        return {"loss": loss, "loss_per_token": loss, "bpb": nats / (math.log(2) * max(1.0, n_bytes)),
                "batches": batches}

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
        """``length`` bytes (tokens, on token data) after ``prompt``. A stateful model reads the prompt
        once and then one byte per step with its state; a stateless one gets the last ``context``
        bytes at every step."""
        tokenizer, prompt = self.data.tokenizer, prompt or b"\n"
        out = list(prompt) if tokenizer is None else tokenizer.encode(prompt.decode("utf-8", "replace")).ids
        x = torch.tensor([out[-self.context:] if not stateful else out], device=device)
        output, state = forward(x, None)
        for _ in range(length):
            logits = logits_of(output)[0, -1, :self.data.vocab_size]     # (V,): no id the tokenizer lacks
            probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=generator))
            out.append(nxt)
            if stateful:
                output, state = forward(torch.tensor([[nxt]], device=device), state)
            else:
                output, _ = forward(torch.tensor([out[-self.context:]], device=device), None)
        return bytes(out) if tokenizer is None else tokenizer.decode(out).encode("utf-8")
