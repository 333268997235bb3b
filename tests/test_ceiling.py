"""The overflow ceiling: the largest gradient backward makes anywhere, unscaled, per step."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fp16probe import Probe, Report
from fp16probe.report import StepTrace


class Scaled(nn.Module):
    """Functional code after the last module: the output gradient is 2^20 x what modules see."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * 2.0**-20


def _every_gradient_max(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Reference: max |g| over the output's gradient, every intermediate and every weight grad."""
    model.zero_grad()
    h1 = model.a(x)
    r = torch.relu(h1)
    h2 = model.b(r)
    out = h2 * 2.0**-20
    for t in (h1, r, h2, out):
        t.retain_grad()
    ((out - y) ** 2).mean().backward()
    grads = [t.grad for t in (h1, r, h2, out)] + [p.grad for p in model.parameters()]
    return max(g.abs().max().item() for g in grads)


def test_ceiling_sees_the_gradient_at_the_output_that_module_hooks_miss():
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(32, 8), torch.randn(32, 4) * 2.0**-20
    with Probe(model) as probe:
        for _ in range(2):
            model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            probe.step()
    report = probe.report()
    expected = _every_gradient_max(model, x, y)
    assert report.trace.ceiling == (expected, expected)
    module_max = max(max(_step_max(report.trace, k)) for k in ("activation_grad", "weight_grad"))
    assert expected > 2.0**15 * module_max  # the blind spot is real: 2^20 at the output


def test_watch_adds_the_loss_side_gradients():
    torch.manual_seed(0)
    model, x = nn.Linear(4, 4), torch.randn(8, 4)
    with Probe(model) as probe:
        loss = (model(x) * 2.0**-12).sum()  # loss-side code outside the model
        probe.watch(loss)
        loss.backward()
        probe.step()
    # d loss / d (out * 2^-12) = 1: only the walk from the loss sees it.
    assert probe.report().trace.ceiling == (1.0,)
    model.zero_grad()
    with Probe(model) as probe:
        (model(x) * 2.0**-12).sum().backward()
        probe.step()
    grads = [2.0**-12, model.weight.grad.abs().max().item(), model.bias.grad.abs().max().item()]
    assert probe.report().trace.ceiling == (max(grads),)
    assert max(grads) < 2.0**-6


def test_ceiling_is_unscaled_by_the_grad_scaler_and_inf_on_overflow():
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(32, 8), torch.randn(32, 4) * 2.0**-20
    reference = _every_gradient_max(model, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    bad = x.clone()
    bad[0, 0] = math.inf  # the second step's backward holds inf/NaN
    with Probe(model, scaler=scaler) as probe:
        for batch in (x, bad):
            model.zero_grad()
            scaler.scale(((model(batch) - y) ** 2).mean()).backward()
            probe.step()
    report = probe.report()
    assert report.trace.ceiling[0] == reference
    assert report.trace.ceiling[1] == math.inf and report.trace.found_inf[1]
    text = report.to_json()
    assert '"inf"' in text
    back = Report.from_dict(json.loads(text))
    assert back.trace.ceiling == (reference, math.inf)


def test_reports_without_a_ceiling_load_with_none():
    d = StepTrace(steps=(0,), scale=(None,), found_inf=(False,)).to_dict()
    assert "ceiling" not in d
    assert StepTrace.from_dict(d).ceiling is None
    merged = Report.from_dict(
        {"schema_version": 1, "metadata": {"fp16probe_version": "0", "torch_version": "0", "device": "cpu",
                                           "model_class": "M"}, "modules": [], "trace": d}
    )
    assert merged.trace.ceiling is None


def test_a_module_whose_forward_is_bypassed_is_named():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    q = torch.randn(2, 5, 8)
    with Probe(mha) as probe:
        out, _ = mha(q, q, q)
        out.square().sum().backward()
        probe.step()
    report = probe.report()
    assert list(report.capture.unrecorded_modules) == ["out_proj"]
    # The ceiling still sees out_proj's weight gradient and the attention internals.
    assert report.trace.ceiling[0] >= mha.out_proj.weight.grad.abs().max().item() > 0


# -- the ceiling against a brute-force walk of every autograd node ----------------------
class _AttnBlock(nn.Module):
    """nn.MultiheadAttention (uses out_proj.weight directly) with functional code after it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = x + a
        return (self.head(torch.nn.functional.gelu(h)).flatten(1) * 2.0**-9).reshape(x.shape[0], -1)


class _ConvNet(nn.Module):
    """Conv, batch norm, in-place ReLU, pooling and a functional scale after the last module."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu_(self.bn(self.conv(x)))
        return self.fc(h.mean((2, 3))) * 3.0


def _brute_force_max(loss: torch.Tensor) -> list[torch.Tensor]:
    """Hook every node behind ``loss``; collect max |g| of each non-scalar gradient flowing in.

    The ceiling's own rules: scalar gradients (the loss side's arithmetic) and nodes that the
    dtype tracking marked as fp32 under autocast are left out.
    """
    from fp16probe.capture.ceiling import FP32_ONLY

    seen: list[torch.Tensor] = []

    def prehook(grads):
        for g in grads:
            if isinstance(g, torch.Tensor) and g.numel() > 1:
                seen.append(g.detach().abs().max())

    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        if not node.metadata.get(FP32_ONLY):
            node.register_prehook(prehook)
        stack.extend(n for n, _ in node.next_functions)
    return seen


def test_ceiling_equals_a_brute_force_max_over_every_node_gradient():
    torch.manual_seed(0)
    cases = [
        (Scaled(), lambda: torch.randn(16, 8), lambda out: ((out - 1e-6) ** 2).mean()),
        (_AttnBlock(), lambda: torch.randn(4, 6, 16), lambda out: (out.float() * 2.0**12).pow(2).mean()),
        (_ConvNet(), lambda: torch.randn(4, 3, 8, 8), lambda out: torch.nn.functional.cross_entropy(
            out, torch.arange(4) % 5)),
    ]
    for model, make_x, loss_fn in cases:
        expected = []
        with Probe(model) as probe:
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                loss = loss_fn(model(make_x()))
                probe.watch(loss)
                seen = _brute_force_max(loss)
                loss.backward()
                expected.append(max(float(m) for m in seen))
                probe.step()
        got = probe.report().trace.ceiling
        assert got == tuple(expected), (type(model).__name__, got, expected)
        assert len(set(got)) > 1 or type(model) is Scaled  # real data, not one constant


# -- what the ceiling costs: marks reused, covered nodes left to the histograms ------------
class _RMSNorm(nn.Module):
    """Computes in fp32 whatever its input (as Llama's does): its internals stay fp32 under autocast."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h32 = h.to(torch.float32)
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h32.to(h.dtype)


class _NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.norm = _RMSNorm(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = self.norm(self.a(x))
        if extra:  # another graph: one more op, and the norm's internals come later in the walk
            h = torch.tanh(h) * 2.0**6
        return self.b(h)


def _ceilings(model: nn.Module, batches: list[tuple[torch.Tensor, bool]]) -> tuple[tuple[float, ...], Probe]:
    with Probe(model) as probe:
        for x, extra in batches:
            model.zero_grad(set_to_none=True)
            model(x, extra).pow(2).mean().backward()
            probe.step()
    return probe.report().trace.ceiling, probe


def test_dtype_marks_are_reused_while_the_graph_repeats(monkeypatch):
    import fp16probe.capture.ceiling as ceiling_module

    torch.manual_seed(0)
    model = _NormNet()
    batches = [(torch.randn(4, 5, 16) * 0.05, False) for _ in range(6)]  # small: the norm's rsqrt grads are large
    reused, probe = _ceilings(model, batches)
    assert (probe.collector("ceiling").hooks.forwards_tracked, probe.collector("ceiling").hooks.forwards_reused) == (1, 5)
    monkeypatch.setattr(ceiling_module, "_RECHECK_EVERY", 0)  # track every forward
    tracked, every = _ceilings(model, batches)
    assert (every.collector("ceiling").hooks.forwards_tracked, every.collector("ceiling").hooks.forwards_reused) == (6, 0)
    assert reused == tracked
    monkeypatch.setattr(ceiling_module, "_RECHECK_EVERY", 2)
    assert _ceilings(model, batches)[1].collector("ceiling").hooks.forwards_tracked == 2  # steps 1 and 4
    # The marks matter: without them the norm's fp32 internals would set the ceiling.
    blind = Probe(model, regime="pure_fp16")  # a .half() model: no gradient stays fp32, no dtype tracking
    with blind:
        for x, extra in batches:
            model.zero_grad(set_to_none=True)
            model(x, extra).pow(2).mean().backward()
            blind.step()
    assert all(b > r for b, r in zip(blind.report().trace.ceiling, reused))


def test_a_forward_without_a_graph_keeps_the_marks():
    """A validation forward under no_grad between training steps does not make the next one track again."""
    torch.manual_seed(0)
    model = _NormNet()
    x = torch.randn(4, 5, 16) * 0.05
    with Probe(model) as probe:
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            with torch.no_grad():
                model(x)
            probe.step()
    assert (probe.collector("ceiling").hooks.forwards_tracked, probe.collector("ceiling").hooks.forwards_reused) == (1, 3)


def test_a_graph_that_changes_is_tracked_again_and_never_undercounted(monkeypatch):
    import fp16probe.capture.ceiling as ceiling_module

    torch.manual_seed(0)
    model = _NormNet()
    pattern = [False, False, True, True, False, True]
    batches = [(torch.randn(4, 5, 16) * 0.05, extra) for extra in pattern]
    got, probe = _ceilings(model, batches)
    monkeypatch.setattr(ceiling_module, "_RECHECK_EVERY", 0)
    truth, _ = _ceilings(model, batches)
    # Steps 3 and 5 meet another graph than the marks': counted on the safe side (every node
    # after the first difference), and the next forward is tracked: steps 1, 4 and 6.
    assert probe.collector("ceiling").hooks.forwards_tracked == 3
    assert probe.collector("ceiling").hooks.forwards_reused == 1  # step 2 (steps 3 and 5 tried and met another graph)
    for step, (g, t) in enumerate(zip(got, truth)):
        assert g >= t, step
    assert [got[i] == truth[i] for i in (0, 1, 3, 5)] == [True] * 4  # tracked, or the same graph again


def test_nodes_a_histogram_covers_get_no_hook_of_their_own():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(16, 8)

    def run(**kw):
        with Probe(model, **kw) as probe:
            model.zero_grad(set_to_none=True)
            (model(x) * 2.0**8).pow(2).sum().backward()
            probe.step()
        return probe.report().trace.ceiling, probe.collector("ceiling").hooks.nodes_hooked

    full, hooked = run()
    without_histograms, hooked_all = run(activation_grads=False)
    assert full == without_histograms  # the histograms' maximum stands in for the nodes they read
    assert hooked == hooked_all - 3  # the two Linears' and the ReLU's output nodes


class _Escapes(nn.Module):
    """An intermediate left unhooked behind a transpose also feeds the loss through a side channel."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x @ self.w  # its only consumer in the model's graph is the transpose below
        self.side = a
        return self.head(a.t().contiguous() * 0.5)


def test_a_node_passed_through_is_hooked_when_the_loss_reaches_it_another_way():
    torch.manual_seed(0)
    model = _Escapes()
    with Probe(model) as probe:
        model.zero_grad(set_to_none=True)
        out = model(torch.randn(8, 8) * 2.0**-10)  # small: the weight gradients are small
        loss = out.pow(2).mean() + (model.side * 2.0**10).pow(2).mean()
        probe.watch(loss)
        seen = _brute_force_max(loss)
        loss.backward()
        probe.step()
    expected = max(float(m) for m in seen)
    assert probe.report().trace.ceiling == (expected,)
    # the side channel's gradient is the largest: only the re-hooked node holds it
    histograms = max(max(_step_max(probe.report().trace, k)) for k in ("activation_grad", "weight_grad"))
    assert expected > 2.0**5 * histograms


class _Cancels(nn.Module):
    """A view of a module's output is the model's output; the module's output also leaks out."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.side = h
        return h.view(-1)


def test_a_view_over_a_covered_node_counts_itself_once_that_node_has_another_consumer():
    torch.manual_seed(0)
    model = _Cancels()
    with Probe(model) as probe:
        out = model(torch.randn(4, 8))
        # d loss / d out = 2^10 everywhere, and the side channel cancels it at lin's output:
        # only the view's own gradient holds 2^10.
        loss = (out * 2.0**10).sum() - (model.side * 2.0**10).sum()
        probe.watch(loss)
        seen = _brute_force_max(loss)
        loss.backward()
        probe.step()
    assert probe.report().trace.ceiling == (max(float(m) for m in seen),) == (2.0**10,)
    assert probe.collector("ceiling").hooks.nodes_mirrored == 2  # the view, and lin.weight's transpose over its counted gradient


class _Splits(nn.Module):
    """One projection split three ways, as attention splits its qkv (chunk, split or unbind)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        self.side = h
        if self.how == "chunk":
            return h.chunk(3, dim=-1)
        if self.how == "split":
            return h.split([8, 8, 8], dim=-1)
        return h.view(-1, 3, 8).unbind(1)


@pytest.mark.parametrize("how", ["chunk", "split", "unbind"])
def test_a_split_over_a_covered_node_reads_nothing_unless_that_node_has_another_consumer(how):
    """A split's input gradient is its outputs' gradients side by side: over the histogram of lin's output
    it reads nothing, until the loss also reaches lin's output another way (here cancelling the split's
    gradients there, so that only the split's own gradients hold 2^10)."""
    torch.manual_seed(0)
    for side in (0.0, 1.0):
        model = _Splits(how)
        with Probe(model) as probe:
            q, k, v = model(torch.randn(4, 8) * 2.0**-10)  # small: the weight gradients are small
            loss = (q.sum() + k.sum() * (2.0 - side) + v.sum()) * 2.0**10 - (model.side * 2.0**10).sum() * side
            if side:
                probe.watch(loss)  # the walk that finds lin's output's other consumer
            seen = _brute_force_max(loss)
            loss.backward()
            probe.step()
        expected = max(float(m) for m in seen)
        assert probe.report().trace.ceiling == (expected,), (how, side)
        if side:
            assert expected == 2.0**10 > 2.0**5 * max(_step_max(probe.report().trace, "activation_grad"))
        else:
            assert probe.collector("ceiling").hooks.nodes_hooked == 0, how  # the split, the view and lin.weight's transpose mirror


class _Gain(nn.Module):
    """A parameter used as it is (no transpose between it and its AccumulateGrad node)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_gradient_accumulation_keeps_each_backward_in_the_ceiling():
    """Parameters' AccumulateGrad nodes are left to the weight counts: every backward still counts.

    The second micro-batch's gradient is the first's times ``factor``: at -0.5 the first
    backward alone holds the maximum (kept when the second replaces the counts), at -2 the
    second does (its AccumulateGrad node is hooked, also when both forwards ran first).
    """
    torch.manual_seed(0)
    # 64 x 64: a weight counted in its accumulate hook rather than at the end of backward (recorder._HOT_FROM)
    models = (nn.Linear(8, 4), _Gain(8), nn.Linear(64, 64), _Gain(4096))
    cases = [(model, factor, first) for model in models for factor in (-0.5, -2.0) for first in (False, True)]
    for model, factor, both_forwards_first in cases:
        width = model.in_features if isinstance(model, nn.Linear) else model.w.numel()
        x = torch.randn(16, width) * 2.0**10  # large inputs: the weight gradients dominate
        y = torch.randn(16, model(x).shape[1])
        with Probe(model) as probe:
            model.zero_grad(set_to_none=True)
            seen: list[list[torch.Tensor]] = []  # filled as backward runs
            losses = []
            for sign in (1.0, factor):
                losses.append(sign * ((model(x) - y) ** 2).mean())
                probe.watch(losses[-1])
                seen.append(_brute_force_max(losses[-1]))
                if not both_forwards_first:
                    losses.pop().backward()
            for loss in losses:
                loss.backward()
            probe.step()
        expected = max(float(m) for got in seen for m in got)
        report = probe.report()
        assert report.trace.ceiling == (expected,), (type(model).__name__, factor, both_forwards_first)
        assert expected > 2 * max(_step_max(report.trace, "activation_grad"))
        assert expected > max(_step_max(report.trace, "weight_grad"))  # not the accumulated sum


def _step_max(trace, kind: str) -> tuple[float, ...]:
    """The largest finite magnitude of ``kind`` per step."""
    return tuple(h.max_abs for h in trace.histograms.get(kind, ()))
