"""The whole fp16 run: forward overflow and underflow, the loss's dtype, pure-fp16 models.

Every verdict here is checked against a real fp16 run written with plain torch in the test
(CPU fp16 autocast, or a model converted with .half()), not against the tool's own arithmetic.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fp16probe
from fp16probe.presentation.answer import fix_code
from fp16probe.analysis.recommend import analyze
from fp16probe.capture.autocast_rules import output_is_low
from fp16probe.capture.forward import ForwardAudit
from fp16probe.recommendation import Caveat
from docs.examples.fp16_failures import HotMLP  # hidden values near 1e5, as a trained T5's grow
from fp16probe.running.demo import DemoNet, demo_batches, demo_loss
from fp16probe.presentation.verdict import verdict_text


def _batches(n=3, width=16, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, width, generator=g) for _ in range(n)]


@torch.no_grad()
def _fp16_losses(model, batches, loss_fn, device_type="cpu"):
    """Real fp16 autocast forward + loss, as training computes them; the losses as floats."""
    out = []
    for x in batches:
        with torch.autocast(device_type, dtype=torch.float16):
            out.append(float(loss_fn(model(x), x).float()))
    return out


class Attention(nn.Module):
    """Attention whose q @ k.T logits pass 65504 inside a functional matmul."""

    def __init__(self, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        with torch.no_grad():
            self.q.weight.mul_(300.0)
            self.k.weight.mul_(300.0)

    def forward(self, x):
        logits = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(logits.float(), -1).to(x.dtype) @ self.v(x)


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.attn = Attention()
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.attn(self.inp(x)))


def _mse(out, x):
    return out.float().pow(2).mean()


@pytest.mark.parametrize("make, first_module", [(HotMLP, "fc1"), (AttnNet, "attn")])
def test_forward_overflow_is_named_with_a_fix_that_makes_a_real_fp16_run_finite(make, first_module):
    model, batches = make(), _batches()
    with torch.no_grad():
        assert all(math.isfinite(float(_mse(model(x), x))) for x in batches)  # fp32 is fine
    assert not any(math.isfinite(v) for v in _fp16_losses(model, batches, _mse))  # real fp16: NaN/inf every step
    report = fp16probe.profile(copy.deepcopy(model), batches, _mse, steps=3)
    rec = report.recommendation
    assert rec.verdict == "forward_overflow" and rec.grad_scaler_kwargs == {} and rec.log2_scale is None
    first = rec.evidence["forward_overflow"][0]
    assert first["module"] == first_module and first["headroom_bits"] < 0
    assert first_module in rec.evidence["fix_modules"] and "keep_in_fp32" in fix_code(rec)
    assert "no GradScaler setting fixes this" in verdict_text(rec) and "bf16" in verdict_text(rec)
    # The fix as printed makes the real fp16 run finite on every step.
    fixed = fp16probe.keep_in_fp32(copy.deepcopy(model), rec.evidence["fix_modules"], device_type="cpu")
    assert all(math.isfinite(v) for v in _fp16_losses(fixed, batches, _mse))


class TailHot(nn.Module):
    """The overflow in a bias-free projection whose input is fp16 in the target run (as a Gemma MLP's down_proj)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.down = nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4, bias=False)
        with torch.no_grad():
            self.down.weight.mul_(1e5)

    def forward(self, x):
        return self.down(self.act(self.fc1(x)))


@pytest.mark.parametrize("make", [HotMLP, AttnNet, TailHot])
def test_a_model_with_the_printed_fix_applied_profiles_clean_and_verifies(make):
    """The audit sees the fix's autocast-off region: no forward verdict on what it keeps in fp32."""
    model, batches = make(), _batches()
    fix = fp16probe.profile(copy.deepcopy(model), batches, _mse, steps=3).recommendation.evidence["fix_modules"]
    for device_type in ("cuda", "cpu"):  # the fix for the predicted device; --verify runs the CPU's here
        fixed = fp16probe.keep_in_fp32(copy.deepcopy(model), fix, device_type=device_type)
        report = fp16probe.profile(fixed, batches, _mse, steps=3, verify=device_type == "cpu")
        rec = report.recommendation
        assert rec.verdict not in ("forward_overflow", "forward_underflow"), (device_type, rec.verdict)
        kept = [t["name"] for t in report.forward.audit["tensors"]
                if device_type in t["fp16_on"] and any(t["module"] == m or t["module"].startswith(m + ".")
                                                       for m in fix)]
        assert kept == []  # nothing inside the kept modules is fp16 on the device the fix is for
        if device_type == "cpu":
            v = report.verification
            assert v.measured_overflow_steps == 0 and v.held, v.notes
    # and the real fp16 run of the fixed model is finite on every step
    fixed = fp16probe.keep_in_fp32(copy.deepcopy(model), fix, device_type="cpu")
    assert all(math.isfinite(v) for v in _fp16_losses(fixed, batches, _mse))


def test_keep_in_fp32_survives_a_deepcopy():
    """verify() deep-copies the model: the copy's forward must run the copy's weights."""
    model = fp16probe.keep_in_fp32(HotMLP(), ["fc1"], device_type="cpu")
    twin = copy.deepcopy(model)
    _mse(twin(_batches(n=1)[0]), None).backward()
    assert twin.fc1.weight.grad is not None and model.fc1.weight.grad is None


def test_a_ctc_loss_is_fp32_under_cpu_autocast_as_torch_computes_it():
    """ctc_loss has no fake kernel (its output shape depends on data): the CPU lists answer."""
    torch.manual_seed(0)
    model = nn.Linear(8, 5)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(12, 2, 8, generator=g) for _ in range(2)]
    targets, lengths, target_lengths = torch.tensor([[1, 2, 3], [4, 1, 2]]), torch.tensor([12, 12]), torch.tensor([3, 3])

    def ctc(out, x):
        return torch.nn.functional.ctc_loss(out.log_softmax(-1), targets, lengths, target_lengths)

    with torch.autocast("cpu", dtype=torch.float16):
        assert ctc(model(batches[0]), None).dtype == torch.float32  # torch: fp32 on CPU autocast
    report = fp16probe.profile(copy.deepcopy(model), batches, ctc, steps=2)
    assert "cpu" not in report.forward.audit["loss_fp16_on"]
    assert not any(c.code == "loss_fp16" for c in analyze(report, target="cpu").caveats)


def test_a_few_bits_of_forward_headroom_is_a_caveat_before_it_overflows():
    model = HotMLP()
    with torch.no_grad():
        model.fc1.weight.div_(8.0)  # about 1e4: 2-3 bits below 65504
    report = fp16probe.profile(model, _batches(), _mse, steps=2)
    rec = report.recommendation
    assert rec.verdict != "forward_overflow"
    low = [c.data for c in rec.caveats if c.code == "forward_low_headroom"]
    assert len(low) == 1 and any(name.startswith("fc1") for name, _ in low[0]["tensors"])
    assert all(t["headroom_bits"] < 3 for t in rec.evidence["forward_low_headroom"])


def test_trained_t5_feed_forward_overflow_names_wo():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                   num_heads=2, dropout_rate=0.0, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():  # trained T5 checkpoints' wo outputs reach about 8e4
        for block in model.encoder.block:
            block.layer[-1].DenseReluDense.wo.weight.mul_(3e4)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(1, 64, (2, 8), generator=g),
                "labels": torch.randint(1, 64, (2, 6), generator=g)} for _ in range(2)]

    @torch.no_grad()
    def real_losses(m):
        out = []
        for b in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                out.append(float(m(**b).loss))
        return out

    assert not any(math.isfinite(v) for v in real_losses(model))
    rec = fp16probe.profile(copy.deepcopy(model), batches, steps=2).recommendation
    assert rec.verdict == "forward_overflow"
    assert rec.evidence["forward_overflow"][0]["module"].endswith("DenseReluDense.wo")
    fixed = fp16probe.keep_in_fp32(copy.deepcopy(model), rec.evidence["fix_modules"], device_type="cpu")
    assert all(math.isfinite(v) for v in real_losses(fixed))


# -- the loss's own dtype -------------------------------------------------------------------


def _small_grads_model():
    torch.manual_seed(0)
    return DemoNet(depth=8, width=16)


def _grads_overflow(model, batches, loss_fn, scale):
    """Real fp16 autocast step at a constant scale: whether any gradient was inf/NaN, per step."""
    out = []
    for x in batches:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), x)
        (loss * scale).backward() if loss.dtype == torch.float32 else loss.backward(torch.tensor(scale, dtype=loss.dtype))
        out.append(any(not torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None))
    return out


@pytest.mark.parametrize("loss_fn, cuda_fp16, cpu_fp16", [
    (lambda out, x: out.abs().mean(), True, True),
    (lambda out, x: -out.mean(), True, True),
    (lambda out, x: out.pow(2).mean(), False, True),
    (lambda out, x: (out - x[:, :1].float()).abs().mean(), False, False),
])
def test_the_loss_dtype_follows_each_devices_autocast_and_caps_s(loss_fn, cuda_fp16, cpu_fp16):
    model, batches = _small_grads_model(), _batches(n=3, width=16, batch=64)
    # torch's own CPU autocast agrees with the prediction for the CPU
    with torch.autocast("cpu", dtype=torch.float16):
        assert (loss_fn(model(batches[0]), batches[0]).dtype == torch.float16) is cpu_fp16
    report = fp16probe.profile(copy.deepcopy(model), batches, loss_fn, steps=3)
    assert report.forward.audit["loss_fp16_on"] == [t for t, v in (("cpu", cpu_fp16), ("cuda", cuda_fp16)) if v]
    cpu = analyze(report, target="cpu")
    cuda = analyze(report, target="cuda")
    assert cpu.evidence["loss_fp16"] is cpu_fp16 and cuda.evidence["loss_fp16"] is cuda_fp16
    if cpu_fp16:
        assert Caveat("loss_fp16", {"regime": "autocast", "target": "cpu"}) in cpu.caveats
    # The CPU verdict's S (or, where the forward flushes, the backward's) overflows on no real CPU fp16 step.
    k = cpu.log2_scale if cpu.log2_scale is not None else cpu.evidence.get("backward_log2_scale")
    if cpu_fp16:
        assert k is not None and k <= 15
    if k is not None:
        assert not any(_grads_overflow(copy.deepcopy(model), batches, loss_fn, 2.0**k))
    if cpu_fp16:  # and the cap is real: 2^16 overflows every step when the loss is fp16
        assert all(_grads_overflow(copy.deepcopy(model), batches, loss_fn, 2.0**16))


# -- forward underflow ------------------------------------------------------------------------


class TinyInputs(nn.Module):
    def __init__(self, gain_in=1.0, gain_out=1.0):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.gain_in, self.gain_out = gain_in, gain_out

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x * self.gain_in))) * self.gain_out


def _zero_share_after_cast(t):
    nz = t != 0
    return float(((t.to(torch.float16) == 0) & nz).sum() / nz.sum())


def test_inputs_scaled_into_the_flush_range_are_predicted_as_forward_underflow():
    model, batches = TinyInputs(gain_in=2.0**-30), _batches()
    rec = fp16probe.profile(copy.deepcopy(model), batches, _mse, steps=3).recommendation
    assert rec.verdict == "forward_underflow" and "fc1" in rec.evidence["fix_modules"]
    row = next(t for t in rec.evidence["forward_flushing"] if t["name"] == "fc1/linear:in")
    # Measured: what a real fp16 autocast run makes of fc1's input (autocast casts it to fp16).
    seen = []
    hook = model.fc1.register_forward_pre_hook(lambda m, a: seen.append(_zero_share_after_cast(a[0])))
    with torch.autocast("cpu", dtype=torch.float16):
        for x in batches:
            model(x)
    hook.remove()
    measured = sum(seen) / len(seen)
    assert measured > 0.5 and row["flushed_fraction"] == pytest.approx(measured, rel=0.2)


def test_an_output_gain_that_flushes_the_output_is_forward_underflow():
    model, batches = TinyInputs(gain_out=2.0**-30), _batches()
    rec = fp16probe.profile(copy.deepcopy(model), batches, lambda o, x: o.float().pow(2).mean(),
                            steps=3).recommendation
    assert rec.verdict == "forward_underflow"
    row = rec.evidence["forward_flushing"][0]
    assert row["name"].startswith("(model)/mul")
    with torch.autocast("cpu", dtype=torch.float16):
        outs = [model(x) for x in batches]
    measured = sum(float((o == 0).float().mean()) for o in outs) / len(outs)
    assert row["flushed_fraction"] == pytest.approx(measured, rel=0.2)


# -- pure fp16 (.half()) ----------------------------------------------------------------------


def test_a_half_model_is_predicted_as_pure_fp16_and_its_scale_holds_in_a_real_half_run():
    torch.manual_seed(0)
    model = DemoNet(depth=8, width=32).half()
    batches = [b for _, b in zip(range(3), demo_batches(width=32, batch=64))]
    report = fp16probe.profile(copy.deepcopy(model), batches, demo_loss, steps=3)
    assert report.metadata.regime == "pure_fp16"
    rec = report.recommendation
    assert rec.evidence["regime"] == "pure_fp16" and rec.evidence["loss_fp16"] is True
    assert rec.log2_scale is not None and rec.log2_scale <= 15

    def half_run_overflows(scale):
        m = copy.deepcopy(model)  # the user's regime: .half(), no autocast, loss.float() * S as DeepSpeed does
        out = []
        for x, y in batches:
            m.zero_grad()
            loss = demo_loss(m(x.half()), (x.half(), y.half()))
            (loss.float() * scale).backward()
            out.append(any(not torch.isfinite(p.grad).all() for p in m.parameters()))
        return out

    assert not any(half_run_overflows(2.0 ** rec.log2_scale))
    assert all(half_run_overflows(2.0**17))


# -- custom autograd Functions ------------------------------------------------------------------


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return (g * 2.0**20) / 2.0**20  # overflows in fp16 long before the ceiling sees it


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return _Scaled.apply(self.fc(x))


def test_a_custom_function_in_the_graph_is_a_caveat_that_suggests_verify():
    rec = fp16probe.profile(WithFunction(), _batches(), _mse, steps=2).recommendation
    assert rec.evidence["custom_functions"] == ["_ScaledBackward"]
    assert Caveat("custom_functions", {"functions": ["_ScaledBackward"]}) in rec.caveats


# -- the rules themselves -----------------------------------------------------------------------


def test_autocast_rules_match_torch_on_this_device_and_the_documented_cuda_lists():
    x = torch.randn(4, 4)
    h = torch.randn(4, 4)
    low = {id(h)}

    def is_low(t):
        return id(t) in low

    cases = [(torch.mm, (x, x)), (torch.Tensor.abs, (h,)), (torch.Tensor.pow, (h, 2)), (torch.Tensor.sum, (h,)),
             (torch.softmax, (h, -1)), (torch.exp, (h,)), (torch.Tensor.add, (h, x)),
             (torch.nn.functional.layer_norm, (h, (4,)))]
    for func, args in cases:  # CPU: torch's own autocast on real tensors is the oracle
        real = tuple(a.half() if isinstance(a, torch.Tensor) and id(a) in low else a for a in args)
        with torch.autocast("cpu", dtype=torch.float16):
            expected = func(*real).dtype == torch.float16
        assert output_is_low(func, args, {}, is_low, "cpu") is expected, func
    # CUDA: the documented lists (torch's Autocast Op Reference) for ops that differ from the CPU.
    for func, args, expected in [(torch.Tensor.pow, (h, 2), False), (torch.Tensor.sum, (h,), False),
                                 (torch.softmax, (h, -1), False), (torch.exp, (h,), False),
                                 (torch.mm, (x, x), True), (torch.Tensor.abs, (h,), True)]:
        assert output_is_low(func, args, {}, is_low, "cuda") is expected, func


def test_the_audit_leaves_the_run_unchanged():
    model, batches = HotMLP(), _batches(n=1)
    plain = model(batches[0])
    audit = ForwardAudit(model)
    with audit.step(0):
        audited = model(batches[0])
    assert torch.equal(plain, audited)
    assert audit.result()["tensors"]


# -- --verify runs the fix, the regime, and names the cause ---------------------------------------


def test_verify_applies_the_forward_fix_and_proves_the_run_finite():
    model, batches = HotMLP(), _batches()
    report = fp16probe.profile(copy.deepcopy(model), batches, _mse, steps=3, verify=True)
    v = report.verification
    assert report.recommendation.verdict == "forward_overflow"
    assert report.metadata.target == "cpu"  # verify on a CPU checks the CPU's prediction
    assert v.held and v.measured_overflow_steps == 0 and any("kept in fp32" in n for n in v.notes)


def test_verify_names_the_cause_it_sees_when_the_forward_overflows():
    import dataclasses

    model, batches = HotMLP(), _batches()
    report = fp16probe.profile(copy.deepcopy(model), batches, _mse, steps=3)
    blind = dataclasses.replace(report, forward=None)
    blind = blind.with_recommendation(analyze(blind, target="cpu"))  # what the gradients alone would say
    assert blind.recommendation.verdict not in ("forward_overflow", "forward_underflow")
    v = fp16probe.verify(copy.deepcopy(model), blind, batches, _mse)
    assert not v.held
    assert any("loss was inf/NaN from step 1" in n for n in v.notes)
    assert any("first module whose fp16 forward output held inf/NaN was fc1" in n for n in v.notes)


def test_verify_of_a_half_model_runs_it_as_half():
    torch.manual_seed(0)
    model = DemoNet(depth=8, width=32).half()
    batches = [b for _, b in zip(range(3), demo_batches(width=32, batch=64))]
    report = fp16probe.profile(copy.deepcopy(model), batches, demo_loss, steps=3, verify=True)
    v = report.verification
    assert any(".half(), no autocast" in n for n in v.notes)
    assert v.measured_overflow_steps == 0
    assert v.by_kind["weight_grad"]["relative_error"] is not None


def test_the_device_check_that_bench_gpu_check_runs_on_a_gpu_agrees_on_this_cpu():
    from fp16probe.capture.autocast_rules import compare_with_device

    got = compare_with_device("cpu")
    assert got["checked"] >= 20 and got["disagree"] == [] and got["agree"] == got["checked"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_rules_agree_with_cuda_autocast_on_a_gpu():
    from fp16probe.capture.autocast_rules import compare_with_device

    got = compare_with_device("cuda")
    assert got["disagree"] == [], got["disagree"]


def test_verify_judges_values_not_only_zeros():
    """An output gain that flushes the output: the zeros agree with nothing, and the values are far off."""
    model, batches = TinyInputs(gain_out=2.0**-30), _batches()
    report = fp16probe.profile(copy.deepcopy(model), batches, lambda o, x: o.float().pow(2).mean(), steps=3,
                               verify=True)
    v = report.verification
    assert not v.held
    assert v.by_kind["weight_grad"]["relative_error"] > 0.05
    assert any("% off the fp32 run's" in n for n in v.notes)


def test_a_probe_in_a_real_fp16_loop_sees_the_forward_overflow_where_it_happens():
    model, batches = HotMLP(), _batches(n=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with fp16probe.Probe(model, scaler=scaler) as probe:
        for x in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _mse(model(x), x)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            probe.step()
    report = probe.report()
    fm = report.forward
    assert fm.module_max["fc1"] == math.inf and fm.first_overflow_step["fc1"] == 0 and len(fm.step_max) == 4
    assert report.to_dict()["forward"]["modules"]["fc1"] == "inf"
    rec = analyze(report)
    assert rec.verdict == "forward_overflow" and rec.evidence["forward_source"] == "modules"
    assert rec.evidence["forward_overflow"][0]["name"] == "fc1" and "fc1" in rec.evidence["fix_modules"]
    assert "scale_induced_overflow" not in [c.code for c in rec.caveats]


def test_the_audit_leaves_cleanly_when_a_signal_took_its_mode_off_the_stack():
    """A signal between torch's pop and push of the running mode must not turn into a RuntimeError."""
    model, x = HotMLP(), _batches(n=1)[0]
    audit = ForwardAudit(model)
    with pytest.raises(KeyboardInterrupt):
        with audit.step(0):
            model(x)
            torch._C._pop_torch_function_stack()  # what an interrupt inside the dispatch leaves behind
            raise KeyboardInterrupt
    assert torch.overrides._get_current_function_mode_stack() == []
    with audit.step(1):  # and the next step works
        model(x)
    assert torch.overrides._get_current_function_mode_stack() == []
