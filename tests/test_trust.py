"""Verdicts a real fp16 run bears out, on models with each blind spot of issue 11.

For every model: profile it in fp32 with a Probe, ask :func:`analyze` for fp16, check the
verdict, then train the same weights on the same batches in real fp16 CPU autocast under
``torch.amp.GradScaler("cpu", **rec.grad_scaler_kwargs)`` and check that no step overflows
and that the fraction of the fp32 run's nonzero gradient values that came out zero is the
predicted one, within a stated tolerance. The weights do not move (lr = 0), so both runs
see the same gradients up to fp16 rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16probe import Probe
from fp16probe.analysis.recommend import analyze
from fp16probe.recommendation import Verdict
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD, Report
from fp16probe.presentation.verdict import verdict_text

STEPS = 4
JUDGED = (ACTIVATION_GRAD, WEIGHT_GRAD)
# fp16 rounding moves a few values across the flush edge and ReLU/GELU kinks: the measured
# share of zeroed values may differ from the exact prediction by 0.1 point plus 10% of it.
TOLERANCE_ABS, TOLERANCE_REL = 1e-3, 0.1


# -- the models ---------------------------------------------------------------------------
class OutputMultiplier(nn.Module):
    """A muP-style functional output multiplier after the last module."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * 2.0**-20


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Attention(nn.Module):
    """nn.MultiheadAttention: its out_proj never runs as a module, hooks on it see nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.head.weight.mul_(64.0)  # gradients grow 64x on their way into the attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a)


class TinyInputs(nn.Module):
    """Inputs near fp16's min normal: the first layer's weight gradients underflow, activations do not."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ZeroHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


class Projections(nn.Module):
    """Biased Linears on 3-D input (BERT's q/k/v): each returns a view of its addmm."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.q(x) * self.k(x))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: computed in fp32 whatever the input's dtype, cast back at the end."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h32 = h.to(torch.float32)
        var = h32.pow(2).mean(-1, keepdim=True)
        return self.weight * (h32 * torch.rsqrt(var + self.eps)).to(dtype)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.norm = RMSNorm(32)
        self.down = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


# -- the cases ----------------------------------------------------------------------------
Batch = tuple[torch.Tensor, torch.Tensor]


def _batches(shape: tuple[int, ...], target: Callable[[torch.Generator], torch.Tensor], x_scale: float = 1.0,
             seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) * x_scale, target(g)) for _ in range(STEPS)]


def mse(scale: float = 1.0) -> Callable[[nn.Module, Batch], torch.Tensor]:
    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.mse_loss(model(batch[0]).float(), batch[1]) * scale

    return loss


def weighted_mse(top: int) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """MSE with per-output weights from 1 down to 2^-top: the output gradients span 2*top bits."""
    w = 2.0 ** -torch.linspace(0, top, 4)

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.mse_loss(model(batch[0]).float() * w, batch[1] * w)

    return loss


def tempered_ce(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A temperature applied in the loss function, outside the model: logits / 2^12."""
    return F.cross_entropy(model(batch[0]) / 2.0**12, batch[1])


@dataclass
class Case:
    make: Callable[[], nn.Module]
    batches: Callable[[], list[Batch]]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    verdicts: set[Verdict]
    granularity: str = "module"
    weight_grads: bool = True
    profile_scaler: dict | None = None  # profile under fp16 autocast with this GradScaler
    check: Callable[[Report, object], None] = field(default=lambda report, rec: None)


def _ceiling_above_module_hooks(report: Report, rec: object) -> None:
    """The blind spot is real: the largest gradient is one no module hook saw."""
    hooked = max(max(_step_max(report.trace, k)) for k in JUDGED)
    assert min(report.trace.ceiling) > 4 * hooked


def _weight_grads_flush_at_1(report: Report, rec: object) -> None:
    act, weight = report.histogram(ACTIVATION_GRAD), report.histogram(WEIGHT_GRAD)
    assert act.flushed("fp16") < 0.002 * act.nonzero_finite
    assert weight.flushed("fp16") > 0.5 * weight.nonzero_finite  # a real fp16 step loses these at S = 1


def _attention_finding(report: Report, rec: object) -> None:
    assert list(report.capture.unrecorded_modules) == ["attn.out_proj"]


def _q_k_recorded(report: Report, rec: object) -> None:
    names = {m.name for m in report.modules_of(ACTIVATION_GRAD)}
    assert {"q/linear", "k/linear", "out/linear"} <= names


def _rmsnorm_internals_out(report: Report, rec: object) -> None:
    assert list(report.capture.autocast_fp32_ops) == ["norm/add", "norm/mean", "norm/pow", "norm/rsqrt"]


def _backed_off(report: Report, rec: object) -> None:
    assert report.metadata.precision == "fp16-autocast"
    assert any(report.trace.found_inf) and not all(report.trace.found_inf)
    scales = [s for s in report.trace.scale if s is not None]
    assert scales[-1] < scales[0]


CASES = {
    "output-multiplier": Case(
        OutputMultiplier, lambda: _batches((8, 16), lambda g: torch.randn(8, 8, generator=g) * 2.0**-20),
        mse(), {Verdict.CONSTANT}, check=_ceiling_above_module_hooks,
    ),
    "temperature-before-loss": Case(
        Classifier, lambda: _batches((8, 16), lambda g: torch.randint(0, 10, (8,), generator=g)),
        tempered_ce, {Verdict.CONSTANT, Verdict.NONE_NEEDED}, check=_ceiling_above_module_hooks,
    ),
    "multihead-attention": Case(
        Attention, lambda: _batches((2, 6, 8), lambda g: torch.randn(2, 6, 4, generator=g)),
        mse(2.0**-16), {Verdict.CONSTANT}, check=_attention_finding,
    ),
    "weight-grads-underflow": Case(
        TinyInputs, lambda: _batches((8, 16), lambda g: torch.randn(8, 4, generator=g), x_scale=2.0**-11),
        mse(2.0**-10), {Verdict.CONSTANT}, check=_weight_grads_flush_at_1,
    ),
    "gradients-wider-than-fp16": Case(
        TinyInputs, lambda: _batches((8, 16), lambda g: torch.randn(8, 4, generator=g)),
        weighted_mse(18), {Verdict.NO_SINGLE_SCALE},
    ),
    "zero-initialised-head": Case(
        ZeroHead, lambda: _batches((8, 8), lambda g: torch.zeros(8, 4)),
        mse(), {Verdict.INSUFFICIENT_EVIDENCE},
    ),
    "biased-linear-3d-op-level": Case(
        Projections, lambda: _batches((2, 5, 16), lambda g: torch.randn(2, 5, 4, generator=g)),
        mse(2.0**-24), {Verdict.CONSTANT}, granularity="op", weight_grads=False, check=_q_k_recorded,
    ),
    "rmsnorm-fp32-op-level": Case(
        NormNet, lambda: _batches((2, 5, 16), lambda g: torch.randn(2, 5, 4, generator=g)),
        mse(2.0**-20), {Verdict.CONSTANT}, granularity="op", check=_rmsnorm_internals_out,
    ),
    "fp16-profile-gradscaler-backed-off": Case(
        TinyInputs, lambda: _batches((8, 16), lambda g: torch.randn(8, 4, generator=g), x_scale=2.0**-11, seed=3),
        mse(2.0**-10), {Verdict.CONSTANT, Verdict.DYNAMIC},
        profile_scaler={"init_scale": 2.0**40, "backoff_factor": 2.0**-8, "growth_interval": 10**6},
        check=_backed_off,
    ),
}


# -- the runs -------------------------------------------------------------------------------
@dataclass
class Run:
    report: Report
    overflow_steps: int


def _run(model: nn.Module, batches: list[Batch], case: Case, scaler_kwargs: dict | None, fp16: bool) -> Run:
    """Forward and backward on every batch (weights fixed), under a Probe; count overflowing steps."""
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs) if scaler_kwargs is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = Probe(model, scaler=scaler, granularity=case.granularity, weight_grads=case.weight_grads)
    overflow = 0
    with probe:
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = case.loss(model, batch)
            probe.watch(loss)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            probe.step()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if not all(torch.isfinite(g).all() for g in grads):
                overflow += 1
            if scaler is not None:
                scaler.step(opt)  # skipped on inf/NaN, as in training
                scaler.update()
    report = probe.report()
    # an activation gradient that overflowed counts too, even where it did not reach a weight
    overflow = max(overflow, sum(report.trace.found_inf))
    return Run(report, overflow)


def _zeroed(fp32: Report, fp16: Report) -> float:
    """The share of the fp32 run's nonzero gradient values that came out zero in fp16."""
    nonzero = sum(fp32.histogram(k).nonzero_finite for k in JUDGED)
    if nonzero == 0:
        return 0.0
    lost = sum(fp16.histogram(k).zero - fp32.histogram(k).zero for k in JUDGED)
    return max(lost, 0) / nonzero


def _predicted(fp32: Report, log2_scale: int) -> float:
    """The share of nonzero values that flush at S = 2^log2_scale, from the fp32 histograms."""
    nonzero = sum(fp32.histogram(k).nonzero_finite for k in JUDGED)
    if nonzero == 0:
        return 0.0
    return sum(fp32.histogram(k).flushed("fp16", log2_scale) for k in JUDGED) / nonzero


@pytest.mark.parametrize("name", CASES)
def test_verdict_holds_in_a_real_fp16_run(name: str) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.make()
    batches = case.batches()
    if case.profile_scaler is not None:
        profiled = _run(copy.deepcopy(model), batches, case, case.profile_scaler, fp16=True)
        reference = _run(copy.deepcopy(model), batches, case, None, fp16=False).report
    else:
        profiled = _run(copy.deepcopy(model), batches, case, None, fp16=False)
        reference = profiled.report
    report = profiled.report
    case.check(report, None)
    rec = analyze(report, "fp16")
    assert rec.verdict in case.verdicts, (rec.verdict, rec.text if hasattr(rec, "text") else rec)

    kwargs = dict(rec.grad_scaler_kwargs)
    if rec.verdict is Verdict.INSUFFICIENT_EVIDENCE:
        # nothing to apply: the advice is to profile again, with gradients that say something
        assert "fp32" in verdict_text(rec) or "real loss" in verdict_text(rec) or "train" in verdict_text(rec), verdict_text(rec)
        return
    assert kwargs, f"{rec.verdict} came with no GradScaler settings"
    real = _run(copy.deepcopy(model), batches, case, kwargs, fp16=True)
    assert real.overflow_steps == 0, f"{real.overflow_steps} of {STEPS} steps overflowed at {kwargs}"
    enabled = kwargs.get("enabled", True)
    log2_scale = round(math.log2(kwargs.get("init_scale", 2.0**16))) if enabled else 0
    predicted = _predicted(reference, log2_scale)
    measured = _zeroed(reference, real.report)
    assert abs(measured - predicted) <= TOLERANCE_ABS + TOLERANCE_REL * predicted, (predicted, measured, kwargs)


def _step_max(trace, kind: str) -> tuple[float, ...]:
    """The largest finite magnitude of ``kind`` per step."""
    return tuple(h.max_abs for h in trace.histograms.get(kind, ()))
