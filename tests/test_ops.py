"""Op-level capture finds gradients of functional ops that module hooks cannot see."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16probe import Probe, ProbeError
from fp16probe.capture.engine import histogram
from fp16probe.capture.ops import LAYOUT_OPS, op_name
from fp16probe.capture.recorder import histogram_from


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class Block(nn.Module):
    """A transformer-ish block: one Linear, every other op a functional call."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(d, d) * 0.2)

    def forward(self, x):
        h = F.gelu(self.proj(x))
        att = torch.softmax((h @ self.w).view(x.shape[0], -1, x.shape[-1]), dim=-1)
        return x + att.reshape(x.shape)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.block(x) * 0.5)


def _run(granularity: str, model: nn.Module, x: torch.Tensor, **kw):
    kw.setdefault("target", None)  # these tests compare with this machine's own autocast
    with Probe(model, granularity=granularity, **kw) as probe:
        model.zero_grad()
        model(x).pow(2).mean().backward()
        probe.step()
    return probe.report()


def test_module_granularity_misses_functional_ops_that_op_granularity_finds():
    model, x = Net(), torch.randn(6, 16)
    by_module = {m.name for m in _run("module", model, x).modules_of("activation_grad")}
    report = _run("op", model, x)
    by_op = {m.name: m for m in report.modules_of("activation_grad")}
    assert by_module == {"block.proj", "head"}
    for name in ("block/gelu", "block/softmax", "(model)/mul"):
        assert name not in by_module
        assert by_op[name].histogram.total == x.numel()  # one gradient value per output element
        assert by_op[name].histogram.nonzero_finite > 0
    # x + att takes the fp32 input x: under autocast it stays fp32, and its only consumer
    # (* 0.5, fp32 too) leaves its gradient fp32; * 0.5 feeds the head's fp16 linear.
    assert list(report.capture.autocast_fp32_ops) == ["block/add"]
    assert "block/add" not in by_op
    assert {"block.proj/linear", "head/linear", "block/matmul"} <= set(by_op)
    # views and reshapes carry no new numbers: never recorded
    assert not any(n.split("/")[1].split(".")[0] in LAYOUT_OPS for n in by_op)
    assert report.capture.granularity == "op"
    assert report.module("block/softmax").module_type == "softmax"


def test_op_gradients_are_exact():
    """The op rows hold exactly the histogram of each op output's gradient."""
    model, x = Net(), torch.randn(6, 16)
    grads = {}
    block = model.block
    orig = block.forward

    def forward(inp):
        h = F.gelu(block.proj(inp))
        h.register_hook(lambda g: grads.__setitem__("gelu", g.clone()))
        att = torch.softmax((h @ block.w).view(inp.shape[0], -1, inp.shape[-1]), dim=-1)
        att.register_hook(lambda g: grads.__setitem__("softmax", g.clone()))
        return inp + att.reshape(inp.shape)

    block.forward = forward
    try:
        report = _run("op", model, x)
    finally:
        block.forward = orig
    for op in ("gelu", "softmax"):
        counts, key = histogram(grads[op])
        want = histogram_from(counts.tolist(), int(key))
        assert report.module(f"block/{op}").histogram == want


def test_repeated_ops_are_numbered_and_patterns_select():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            y = x + torch.tanh(self.inner(x))
            return y + torch.tanh(y)

    model = nn.Sequential(Twice(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    report = _run("op", model, x)
    names = {m.name for m in report.modules_of("activation_grad")}
    # y = x + ... is fp32 under autocast (x is), and so is tanh(y); their gradients stay fp32
    assert {"0/add.1", "0/tanh", "0.inner/linear", "1/linear"} <= names
    assert list(report.capture.autocast_fp32_ops) == ["0/add", "0/tanh.1"]
    only = {m.name for m in _run("op", model, x, modules=["0"]).modules_of("activation_grad")}
    assert "1/linear" not in only and {"0/add.1", "0.inner/linear"} <= only


def test_op_capture_respects_every_and_stop():
    model, x = Net(), torch.randn(2, 16)
    probe = Probe(model, granularity="op", every=2, weight_grads=False).start()
    for _ in range(4):
        model(x).sum().backward()
        probe.step()
    probe.stop()
    model(x).sum().backward()  # after stop: nothing recorded, and no mode left behind
    report = probe.report()
    assert report.metadata.steps_seen == 2
    assert report.module("block/gelu").histogram.total == 2 * x.numel()
    assert torch.overrides._get_current_function_mode() is None


def test_op_capture_survives_a_forward_that_raises():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Bad())
    with Probe(model, granularity="op"):
        with pytest.raises(ValueError):
            model(torch.randn(1, 2, requires_grad=True))
        assert torch.overrides._get_current_function_mode() is None


def test_op_name_and_bad_granularity():
    assert op_name(torch.Tensor.__getitem__) == "getitem"
    assert op_name(F.gelu) == "gelu"
    with pytest.raises(ProbeError, match="granularity"):
        Probe(Net(), granularity="tensor")


def test_a_compute_op_whose_output_is_a_view_is_recorded():
    """A biased Linear on 3-D input returns a view of its addmm: it is the op's output, not layout."""
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 3, 8)
    assert lin(x)._is_view()  # the premise: torch returns a view here
    with Probe(lin, granularity="op") as probe:
        out = lin(x)
        out.retain_grad()
        out.pow(2).sum().backward()
        probe.step()
    row = probe.report().module("(model)/linear")
    counts, key = histogram(out.grad)
    assert row.histogram == histogram_from(counts.tolist(), int(key))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: computed in fp32 whatever the input's dtype, cast back at the end."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, h):
        dtype = h.dtype
        h32 = h.to(torch.float32)
        var = h32.pow(2).mean(-1, keepdim=True)
        h32 = h32 * torch.rsqrt(var + self.eps)
        return self.weight * h32.to(dtype)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.norm = RMSNorm(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


def test_rmsnorm_internals_that_autocast_keeps_in_fp32_are_left_out():
    model, x = NormNet(), torch.randn(2, 5, 16)
    report = _run("op", model, x)
    internals = ["norm/add", "norm/mean", "norm/pow", "norm/rsqrt"]
    assert list(report.capture.autocast_fp32_ops) == internals
    names = {m.name for m in report.modules_of("activation_grad")}
    assert not names & set(internals)
    # what the fp16 linears consume, and what is cast back to the input's dtype, counts
    assert {"a/linear", "norm/mul", "norm/mul.1", "b/linear"} <= names
    # the ceiling skips the internals' nodes too: it equals the largest gradient that
    # remains (recorded ops and weight gradients), below the internals' own maximum
    rest = max(max(_step_max(report.trace, k)) for k in ("activation_grad", "weight_grad"))
    assert report.trace.ceiling[0] == rest
    # a module-level Probe works out the same dtypes for its ceiling (no op rows recorded)
    module_level = _run("module", model, x)
    assert module_level.trace.ceiling == report.trace.ceiling
    assert "autocast_fp32_ops" not in module_level.metadata.extra
    # the internals' gradients are larger: counting them would have capped S lower
    model.zero_grad()
    h = model.a(x)
    h32 = h.to(torch.float32)
    var = h32.pow(2).mean(-1, keepdim=True)
    var.retain_grad()
    model.b(model.norm.weight * (h32 * torch.rsqrt(var + model.norm.eps))).pow(2).mean().backward()
    assert var.grad.abs().max().item() > rest


def test_autocast_decides_from_its_own_behaviour_not_a_list():
    """Under a real autocast profile the real dtypes decide; a loss computed in fp32 by autocast is left out."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return F.mse_loss(self.model(x), y)  # autocast runs mse_loss in fp32 on the CPU

    wrapped = WithLoss()
    with Probe(wrapped, granularity="op") as probe:
        wrapped(x).backward()
        probe.step()
    assert "(model)/mse_loss" in probe.report().capture.autocast_fp32_ops


def test_the_left_out_ops_are_a_caveat_of_the_recommendation():
    from fp16probe.analysis.recommend import analyze

    report = _run("op", NormNet(), torch.randn(2, 5, 16))
    (left_out,) = [c.data for c in analyze(report, "fp16").caveats if c.code == "autocast_fp32_ops"]
    assert left_out["count"] == 4 and any("norm/rsqrt" in op for op in left_out["ops"])


def _step_max(trace, kind: str) -> tuple[float, ...]:
    """The largest finite magnitude of ``kind`` per step."""
    return tuple(h.max_abs for h in trace.histograms.get(kind, ()))
