"""The Probe: captures what it should, leaves no trace on the model, survives failures."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp16probe import Probe, ProbeError
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD, WEIGHT_GRAD
from tests.fixtures.models import (
    SmallConvNet,
    SmallTransformer,
    classification_loss,
    conv_batch,
    token_batch,
)

MODELS = {
    "convnet": (SmallConvNet, conv_batch),
    "transformer": (SmallTransformer, token_batch),
}


def train(model, batches, probe=None, raise_at=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, batch in enumerate(batches):
        if raise_at == i:
            raise RuntimeError("boom")
        loss = classification_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if probe is not None:
            probe.step()


def hook_count(model: nn.Module) -> int:
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        n += len(p._backward_hooks or {})
    return n


def snapshot(model: nn.Module):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        [m.training for m in model.modules()],
        [p.requires_grad for p in model.parameters()],
    )


def assert_same(a, b):
    sa, ga, ta, ra = a
    sb, gb, tb, rb = b
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(ga, gb))
    assert ta == tb and ra == rb


@pytest.mark.parametrize("name", MODELS)
def test_probe_changes_nothing_and_leaves_no_hooks(name):
    cls, make_batch = MODELS[name]
    batches = [make_batch() for _ in range(3)]
    plain = cls()
    probed = copy.deepcopy(plain)
    probed.blocks_frozen = None  # an attribute the probe must not care about
    before = hook_count(probed)
    train(plain, batches)
    with Probe(probed, activations=True) as probe:
        assert hook_count(probed) > before
        train(probed, batches, probe)
    assert hook_count(probed) == before
    assert_same(snapshot(plain), snapshot(probed))
    report = probe.report()
    assert report.metadata.steps_seen == 3
    assert set(report.kinds) == {ACTIVATION_GRAD, WEIGHT_GRAD, ACTIVATION}
    # Every leaf module saw activation gradients, every parameter its gradient.
    leaves = [n for n, m in probed.named_modules() if not list(m.children())]
    assert set(report.metadata.hooked_modules) == set(leaves)
    assert {m.name for m in report.modules_of(WEIGHT_GRAD)} == {n for n, _ in probed.named_parameters()}
    assert report.histogram(ACTIVATION_GRAD).total > 0


@pytest.mark.parametrize("name", MODELS)
def test_probe_cleans_up_when_the_loop_raises(name):
    cls, make_batch = MODELS[name]
    model = cls()
    model.train()
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    before_hooks = hook_count(model)
    before = snapshot(model)
    batches = [make_batch() for _ in range(3)]
    with pytest.raises(RuntimeError, match="boom"):
        with Probe(model) as probe:
            train(model, batches, probe, raise_at=2)
    assert hook_count(model) == before_hooks
    assert not probe.active
    # Collected data survives the failure.
    report = probe.report(partial=True)
    assert report.metadata.partial and report.metadata.steps_seen == 2
    # Nothing but the two real training steps changed the model: replay them without a probe.
    replay = copy.deepcopy(model)
    fresh = cls()
    fresh.load_state_dict(before[0])
    next(fresh.parameters()).requires_grad_(False)
    train(fresh, batches[:2])
    assert_same(snapshot(fresh), snapshot(replay))
    assert [p.requires_grad for p in model.parameters()] == before[3]


@pytest.mark.parametrize("width", [5, 80])  # 80: a weight counted in its accumulate hook (recorder._HOT_FROM)
def test_histograms_equal_direct_measurement(width):
    # The activation gradient of a module equals what a plain tensor hook sees.
    model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3 * width))
    seen = {}

    def keep(name):
        def fwd(m, a, out):
            out.register_hook(lambda g: seen.setdefault(name, []).append(g.clone()))
        return fwd

    x = torch.randn(4, 6)
    handles = [model[i].register_forward_hook(keep(str(i))) for i in range(3)]
    with Probe(model) as probe:
        model(x).pow(2).sum().backward()
        probe.step()
    for h in handles:
        h.remove()
    report = probe.report()
    from tests.test_histogram import histogram_of

    for name, grads in seen.items():
        assert report.module(name, ACTIVATION_GRAD).histogram == histogram_of(torch.cat(grads))
    for pname, p in model.named_parameters():
        assert report.module(pname, WEIGHT_GRAD).histogram == histogram_of(p.grad)


@pytest.mark.parametrize("width", [4, 128])  # 128: the weight is counted in its accumulate hook, the bias at the end
def test_weight_grads_count_the_accumulated_gradient_once_per_step(width):
    from fp16probe.capture.recorder import _HOT_FROM
    from tests.test_histogram import histogram_of

    model = nn.Linear(width, width // 2)
    assert (model.weight.numel() >= _HOT_FROM) is (width == 128)
    with Probe(model, activation_grads=False) as probe:
        for _ in range(3):  # gradient accumulation over three micro-batches
            model(torch.randn(2, width)).sum().backward()
        probe.step()
    for name, p in model.named_parameters():
        h = probe.report().module(name, WEIGHT_GRAD).histogram
        assert h.total == p.numel()
        assert h == histogram_of(p.grad)


def test_every_n_samples_only_those_steps():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with Probe(model, every=3) as probe:
        for _ in range(7):
            model(torch.randn(2, 4)).sum().backward()
            probe.step()
    report = probe.report()
    assert report.trace.steps == (0, 3, 6)
    assert report.metadata.steps_total == 7 and report.metadata.steps_seen == 3
    assert report.module("0", ACTIVATION_GRAD).histogram.total == 3 * 2 * 4


def test_module_selection_by_pattern_and_type():
    model = SmallTransformer()
    probe = Probe(model, modules=["encoder.layers.*.linear*"])
    assert probe.hooked_modules == (
        "encoder.layers.0.linear1", "encoder.layers.0.linear2",
        "encoder.layers.1.linear1", "encoder.layers.1.linear2",
    )
    probe = Probe(model, types=nn.LayerNorm, weight_grads=False)
    assert all("norm" in n for n in probe.hooked_modules) and len(probe.hooked_modules) == 5
    with pytest.raises(ProbeError, match="no module of SmallTransformer matches"):
        Probe(model, modules=["nope*"], weight_grads=False)


def test_structured_outputs_are_followed():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            return {"a": y * 2, "b": (y, [y + 1])}

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def forward(self, x):
            out = self.pair(x)
            return out["a"].sum() + out["b"][0].sum() + out["b"][1][0].sum()

    model = Outer()
    with Probe(model, modules=["pair"]) as probe:
        model(torch.randn(2, 3)).backward()
        probe.step()
    # Three output tensors of 2x3 each carried a gradient.
    assert probe.report().module("pair", ACTIVATION_GRAD).histogram.total == 18


def test_a_tensor_appearing_twice_in_an_output_is_counted_once():
    # As Hugging Face outputs do: last_hidden_state is also hidden_states[-1].
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            return {"last": y, "all": (x, y), "other": y * 2}

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.twice = Twice()

        def forward(self, x):
            out = self.twice(x)
            return out["last"].sum() + out["other"].sum()

    model = Outer()
    with Probe(model, modules=["twice"], activations=True) as probe:
        model(torch.randn(2, 3)).backward()
        probe.step()
    report = probe.report()
    # y and y * 2 carry gradients (x does not require grad): 2 tensors of 2x3, not 3.
    assert report.module("twice", ACTIVATION_GRAD).histogram.total == 12
    # Forward values: x, y, y * 2 once each.
    assert report.module("twice", ACTIVATION).histogram.total == 18


def test_gradscaler_histograms_are_unscaled():
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batches = [torch.randn(3, 8) for _ in range(3)]

    def run(scaler, tell_probe):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put
        with Probe(model, scaler=scaler if tell_probe else None) as probe:
            for x in batches:
                loss = model(x).pow(2).mean()
                (scaler.scale(loss) if scaler else loss).backward()
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
                probe.step()
        return probe.report()

    reference = run(None, False)
    scaled = run(torch.amp.GradScaler("cpu", init_scale=2.0**12), True)
    naive = run(torch.amp.GradScaler("cpu", init_scale=2.0**12), False)
    for kind in (ACTIVATION_GRAD, WEIGHT_GRAD):
        for ref in reference.modules_of(kind):
            got = scaled.module(ref.name, kind).histogram
            assert got == ref.histogram, (kind, ref.name)
            # Without telling the Probe, the histogram is the scaled one: shifted by 12 bins.
            wrong = naive.module(ref.name, kind).histogram
            if ref.histogram.nonzero_finite:
                assert wrong.highest_exp == ref.histogram.highest_exp + 12
    assert scaled.trace.scale == (2.0**12,) * 3
    assert reference.trace.scale == (None,) * 3
    assert scaled.metadata.grad_scaler


def test_gradscaler_backoff_and_growth_are_recorded_per_step():
    # loss = 2^8 * sum(out): the output's gradient is 2^8 * S, so S = 2^120 overflows fp32
    # (2^128) and 2^119 does not. growth_interval=2: back off, two clean steps, grow, repeat.
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 1))
    xs = [torch.rand(1, 4) for _ in range(6)]

    def run(scaler):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with Probe(model, scaler=scaler) as probe:
            for x in xs:
                loss = model(x).sum() * 2.0**8
                (scaler.scale(loss) if scaler else loss).backward()
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
                probe.step()
        return probe.report()

    reference = run(None)
    scaled = run(torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=2))
    assert scaled.trace.scale == tuple(2.0**k for k in (120, 119, 119, 120, 119, 119))
    assert scaled.trace.found_inf == (True, False, False, True, False, False)
    assert reference.trace.found_inf == (False,) * 6
    for i, overflowed in enumerate(scaled.trace.found_inf):
        for kind in (ACTIVATION_GRAD, WEIGHT_GRAD):
            got, want = scaled.trace.histograms[kind][i], reference.trace.histograms[kind][i]
            if overflowed:
                assert got.inf > 0
            else:  # unscaled with the scale in force at that backward, not the next one
                assert got == want, (i, kind)


def test_found_inf_is_recorded_per_step():
    model = nn.Linear(3, 1)
    with Probe(model) as probe:
        for i in range(3):
            x = torch.randn(2, 3)
            if i == 1:
                x[0, 0] = float("inf")
            model(x).sum().backward()
            model.zero_grad()
            probe.step()
    report = probe.report()
    assert report.trace.found_inf == (False, True, False)
    assert report.histogram(ACTIVATION_GRAD).inf == 0
    assert report.module("weight", WEIGHT_GRAD).histogram.nonfinite > 0


def test_a_failing_hook_warns_once_and_training_goes_on(monkeypatch):
    import fp16probe.capture.engine as engine_mod

    def broken(x, *args, **kwargs):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(engine_mod, "count_into", broken)
    model = nn.Linear(3, 2)
    with pytest.warns(RuntimeWarning, match="engine exploded"):
        with Probe(model) as probe:
            for _ in range(2):
                model(torch.randn(2, 3)).sum().backward()
                probe.step()
    assert model.weight.grad is not None
    assert probe.report().capture.hook_errors > 1


def test_report_includes_an_unfinished_step_and_stop_keeps_data():
    model = nn.Linear(3, 2)
    probe = Probe(model).start()
    model(torch.randn(2, 3)).sum().backward()
    probe.stop()
    assert not probe.active
    report = probe.report()
    assert report.metadata.steps_seen == 1
    with pytest.raises(ProbeError, match="already started"):
        probe.start().start()
    probe.stop()


def test_bad_arguments():
    with pytest.raises(ProbeError, match="needs a torch.nn.Module"):
        Probe(object())
    with pytest.raises(ProbeError, match="every must be"):
        Probe(nn.Linear(1, 1), every=0)
    with pytest.raises(ProbeError, match="nothing to capture"):
        Probe(nn.Linear(1, 1), activation_grads=False, weight_grads=False, forward=False)


def test_activations_capture_the_forward_pass():
    from tests.test_histogram import histogram_of

    model = nn.Sequential(nn.Linear(3, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3))
        model[0].bias.zero_()
    x = torch.tensor([[1e5, -3.0, 2.0**-30], [0.5, 0.0, 7.0]])
    with Probe(model, activation_grads=False, weight_grads=False, activations=True) as probe:
        with torch.no_grad():
            out = model(x)
        probe.step()
    h = probe.report().module("0", ACTIVATION).histogram
    assert torch.equal(out, x) and h == histogram_of(x)
    assert h.total == 6 and h.zero == 1 and h.max_abs == 1e5
    # 1e5 overflows fp16 at S = 1; 2^-30 flushes to zero.
    assert h.overflows("fp16", 0) and h.flushed("fp16", 0) == 1


def test_precision_is_detected_from_autocast():
    model = nn.Sequential(nn.Linear(4, 4))
    with Probe(model) as probe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4)).float().sum().backward()
        probe.step()
    assert probe.report().metadata.precision == "bf16-autocast"


def test_report_mid_step_and_twice_counts_nothing_twice():
    # report() between two micro-batches of one step, then step(), then report() twice:
    # the step appears once and the weight gradient once (its last accumulated value).
    model = nn.Linear(3, 2)
    xs = [torch.randn(2, 3) for _ in range(4)]
    with Probe(model) as probe:
        model(xs[0]).sum().backward()
        model(xs[1]).sum().backward()
        probe.step()
        model.zero_grad()
        model(xs[2]).sum().backward()
        mid = probe.report()
        model(xs[3]).sum().backward()
        probe.step()
    first, second = probe.report(), probe.report()
    assert mid.trace.steps == (0, 1) and mid.metadata.steps_seen == 2
    assert mid.module("weight", WEIGHT_GRAD).histogram.total == 2 * 6
    for report in (first, second):
        assert report.trace.steps == (0, 1)
        assert report.metadata.steps_seen == 2
        assert report.module("weight", WEIGHT_GRAD).histogram.total == 2 * 6
        assert report.module("(model)", ACTIVATION_GRAD).histogram.total == 4 * 4
        assert [h.total for h in report.trace.histograms[ACTIVATION_GRAD]] == [8, 8]
    from tests.test_histogram import histogram_of

    both = torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()])
    assert first.trace.histograms[WEIGHT_GRAD][1].counts == histogram_of(both).counts


def test_a_kind_first_seen_after_a_step_keeps_one_trace_row_per_step(tmp_path):
    # Step 0 is a no_grad forward (activations only); gradients first arrive at step 1.
    from fp16probe import Report

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with Probe(model, activations=True) as probe:
        with torch.no_grad():
            model(torch.randn(2, 3))
        probe.step()
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
            model.zero_grad()
            probe.step()
    report = probe.report()
    assert report.trace.steps == (0, 1, 2)
    assert [h.total for h in report.trace.histograms[ACTIVATION]] == [2 * 4, 2 * 4, 2 * 4]
    assert [h.total for h in report.trace.histograms[ACTIVATION_GRAD]] == [0, 2 * 4, 2 * 4]
    assert [h.total for h in report.trace.histograms[WEIGHT_GRAD]] == [0, 16, 16]
    assert report.trace.module_max[WEIGHT_GRAD]["0.weight"][0] == 0.0
    assert Report.load(report.save(tmp_path / "r.json")).trace == report.trace


def test_no_grad_forwards_leave_a_training_probes_precision_and_headroom_alone():
    """An RL loop samples and scores without gradients and without autocast (fp32, values past 65504 are fine
    there), then trains under fp16 autocast: the Probe reads the run's precision and forward headroom from the
    training forwards only. A Probe that watches no gradient (forward headroom of inference) reads every forward."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    big = torch.full((2, 4), 3e5)  # the first layer's fp32 output passes 65504
    small = torch.randn(2, 4)
    with Probe(model) as probe:
        for _ in range(2):
            with torch.no_grad():
                model(big)  # a rollout's forward, fp32
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(small)
            out.float().sum().backward()
            model.zero_grad()
            probe.step()
    report = probe.report()
    assert report.metadata.precision == "fp16-autocast"
    assert max(report.section("forward").module_max.values()) < 100
    with Probe(model, activation_grads=False, weight_grads=False) as probe:
        with torch.no_grad():
            model(big)
        probe.step()
    assert max(probe.report().section("forward").module_max.values()) > 65504
