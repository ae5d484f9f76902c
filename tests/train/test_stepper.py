"""The Stepper on the CPU (eager steps, the mode it reports, why it runs eagerly) and
trainer.cuda_graph's parsing (GraphMode.parse)."""
from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
import torch

from bstrain.errors import UserError
from bstrain.train.graphs import CaptureError
from bstrain.train.step import Forward
from bstrain.train.stepper import GraphMode, StepParts, Stepper, eager_reason

CPU = torch.device("cpu")


class _Regression:
    """The task protocol's two step-time calls: a loss and the batch's metrics."""

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, y)

    def batch_metrics(self, output: torch.Tensor, y: torch.Tensor) -> dict:
        return {"abs_err": (output - y).abs().mean()}


def _stepper(mode: GraphMode = GraphMode.auto) -> tuple[Stepper, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    parts = StepParts(Forward(model, None, CPU), _Regression(), optimizer, list(model.parameters()), model, scaler,
                      grad_clip=1.0)
    return Stepper(parts, mode, eager_reason(mode, CPU)), model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=g)                 # (B, features)
    return x, x[:, :4] * 2.0                            # (B, outputs): a target the model can reach


def test_eager_step_returns_the_loss_and_trains():
    stepper, model = _stepper()
    x, y = _batch()
    before = model.weight.detach().clone()
    losses = []
    for _ in range(20):
        loss, grad_norm, metrics, state, skipped = stepper.step(x, y, None)
        losses.append(float(loss))
    assert loss.dim() == 0 and grad_norm.dim() == 0 and torch.isfinite(grad_norm)
    assert set(metrics) == {"abs_err"} and state is None and skipped is None     # stateless, fp32: no skip flag
    assert not torch.equal(model.weight, before) and losses[-1] < losses[0]
    assert model.weight.grad is None                    # the step leaves no gradients behind


@pytest.mark.parametrize("mode, reason", [
    (GraphMode.auto, "needs a CUDA device, got device 'cpu'"),
    (GraphMode.false, "trainer.cuda_graph=false"),
], ids=["auto", "false"])
def test_without_graphs_the_stepper_is_eager_and_says_why(mode, reason):
    stepper, _ = _stepper(mode)
    assert str(stepper.mode) == "eager" and not stepper.graphed and stepper.reason == reason
    stepper.step(*_batch(), None)
    assert str(stepper.mode) == "eager" and not stepper.pop_warm_up()


def test_true_refuses_a_device_without_graphs():
    with pytest.raises(UserError, match=r"^trainer.cuda_graph=true: needs a CUDA device, got device 'cpu' "):
        eager_reason(GraphMode.true, CPU)


class _Uncapturable:
    """A captured step whose (re)capture fails, as after a sparsity update on a model that syncs."""
    graph = None

    def prepare(self, x, y):
        raise CaptureError("the forward reads a tensor on the host (.item())")


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_a_failed_recapture_reports_eager_and_logs_its_reason(caplog, compiled):
    stepper, model = _stepper()
    stepper.captured = _Uncapturable()                  # as if graphed, its graph dropped for new tables
    stepper.mode = replace(stepper.mode, graph=True, compiled=compiled)
    with caplog.at_level(logging.INFO, logger="bstrain"):
        loss, *_ = stepper.step(*_batch(), None)
    eager, eager_model = _stepper(GraphMode.false)
    want, *_ = eager.step(*_batch(), None)
    assert torch.equal(loss, want), "the step ran, eagerly"
    assert torch.equal(model.weight, eager_model.weight)
    assert str(stepper.mode) == ("eager (compiled)" if compiled else "eager")
    assert stepper.reason == "the forward reads a tensor on the host (.item())"
    assert [r.getMessage() for r in caplog.records] == [
        "step: eager; trainer.cuda_graph=auto could not capture it: the forward reads a tensor on the host (.item())"]


def test_true_refuses_a_step_that_cannot_be_captured():
    stepper, _ = _stepper(GraphMode.false)
    stepper.graph_mode, stepper.captured = GraphMode.true, _Uncapturable()
    with pytest.raises(UserError, match=r"^trainer.cuda_graph=true: the step cannot be captured: the forward reads"):
        stepper.step(*_batch(), None)


# --- trainer.cuda_graph -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, mode", [
    ("auto", GraphMode.auto), ("AUTO", GraphMode.auto), (" auto ", GraphMode.auto), (GraphMode.auto, GraphMode.auto),
    ("true", GraphMode.true), ("True", GraphMode.true), (True, GraphMode.true), ("1", GraphMode.true),
    (1, GraphMode.true), ("yes", GraphMode.true), ("on", GraphMode.true), (GraphMode.true, GraphMode.true),
    ("false", GraphMode.false), ("False", GraphMode.false), (False, GraphMode.false), ("0", GraphMode.false),
    (0, GraphMode.false), ("no", GraphMode.false), ("off", GraphMode.false), (GraphMode.false, GraphMode.false),
], ids=repr)
def test_graph_mode_parses_every_spelling(value, mode):
    assert GraphMode.parse(value) is mode


@pytest.mark.parametrize("value", ["sometimes", "", "2", "graph", None, 2.5], ids=repr)
def test_graph_mode_names_the_key_for_a_bad_value(value):
    message = f"trainer.cuda_graph: expected auto, true or false, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GraphMode.parse(value)
