"""Judge a verdict by what the target's precision does to the gradients: the emulated step's error.

The histograms say what flushes and what overflows; the emulated step
(:mod:`fp16probe.capture.emulate`, the report's ``emulation`` section) says how far the
gradients of the target run are from fp32's, per parameter, at the scales it was run at.
A forward finding (a flush, an overflow) is the verdict only when the emulated gradients
show its effect; otherwise it is a caveat and the loss-scale verdict leads. Gradients more
than :data:`TOLERANCE` off with no overflow are silent corruption (fp16's 11-bit
significand, fp16 statistics, cancellation): the verdict names the first module, in forward
order, where the error appears, and the module-kept-in-fp32 step measured beside it.

Pure functions over report data; the words are in :mod:`fp16probe.presentation.answer`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp16probe.analysis.whatif import CANCELLED_BITS, numerically_zero
from fp16probe.emulation import LOSS
from fp16probe.formats import Format, get_format
from fp16probe.recommendation import Caveat, Recommendation, Verdict
from fp16probe.report import Report

__all__ = ["AMBIGUOUS_SHARE", "NOISE_SHARE", "TOLERANCE", "Effect", "ModuleEffect", "effect_at", "effect_of", "fixes_to_try",
           "judge_report", "judged", "numerically_zero_rows", "scales_to_check",
           "with_zeros"]

# A gradient within 5% of fp32's (relative L2 error) counts as unharmed. Rounding alone costs
# 0.04-0.5% on the models measured (docs/fp16-run.md); a flush that matters costs 20-100%. The
# emulation agrees with real CPU autocast within 0.1% of the gradient (tests/test_emulate.py),
# far inside the line.
TOLERANCE = 0.05
# Above TOLERANCE, a gradient's error is judged against its own batch-to-batch noise (fp16probe.capture.noise):
# SGD already tolerates that noise, and a rounding error that is independent from step to step adds to it
# as a smaller batch would (McCandlish et al., arXiv:1812.06162: the update's noise is tr(Sigma)/B, so an
# error r times the noise's RMS acts as a batch 1/(1 + r^2) of the size: r = 0.5, a batch 80% of the size).
# Chmiel et al. (arXiv:2505.19115) judge quantisation noise against the gradient the same way (it stops
# helping once ||g|| < sqrt(3) sigma_q). An alarm needs error > NOISE_SHARE * noise. Evidence: the E[x^2]-E[x]^2
# norm after Linear(bias 8) (tests/test_effect.py) is 5-8% off against noise of 68-92% (ratio <= 0.09) and
# trains like fp32 over 4 seeds (CPU fp16 autocast + GradScaler); the BatchNorm ResNet, 6-12% against
# 110-160%, trained like fp32 over 6 seeds; the same norm after Linear(bias 12), 1400% against 66%, does not.
# docs/evidence.md's trained models (200 steps x 3 seeds, Adam) keep it: at the profiled weights the fine ones sit
# at ratios <= 0.075 and the gradient-error hurts at >= 1.4; it misses a bf16 loss floor reached near convergence
# (0.15 at the initial weights, 2.5 at trained ones). A chosen value inside that gap, not a fitted or general one.
NOISE_SHARE = 0.5
# Under NOISE_SHARE the line raises no alarm, but the evidence does not say "fine" all the way up to it. Dialling
# the cancelling variance of docs/evidence.md (NaiveNorm's bias 8 to 11.5, fp16, 200 steps x 3-6 seeds), errors of
# 0.13, 0.23 and 0.34 of the noise trained outside fp32's band (bias 10, 11.4, 11.3: mean loss +1.9% to +8.3%), 0.12,
# 0.17, 0.19 and 0.23 inside it (bias 9, 11.2, 10.5, 11); under 0.1 every row measured trained like fp32 (the
# evidence table's fine rows at 0.0006-0.075, bias 8 at 0.064). From AMBIGUOUS_SHARE up to NOISE_SHARE the answer
# says the evidence goes both ways and points at --trial, instead of "training will not feel it".
AMBIGUOUS_SHARE = 0.1
# A parameter whose fp32 gradient is below this share of the model's may be fp32 roundoff
# (attention's key bias, zero in exact arithmetic, is 1e-10 of a BERT's): its relative error is
# noise and is judged only when most of its values flushed to zero (an input scaled by 2^-30 makes
# a weight gradient of 1e-9 of the model's, and fp16 zeroes all of it).
NOISE_FLOOR = 1e-7
ZEROED_COUNTS = 0.5
# A parameter whose fp32 gradient is within ROUNDOFF_MARGIN of what fp32 rounding of the same computation makes
# is numerically zero (see numerically_zero_rows): 2^4, so a gradient set aside carries at least 1/16 of its own
# value as fp32 rounding, and no relative error against it means anything.
ROUNDOFF_MARGIN = 16.0
ZERO_KEY = "numerically_zero"  # data's optional list of names the histograms call numerically zero (rejudge adds it)
UNIT_KEY = "_dtype"  # data's format resolved to its torch dtype by effect_of (None: none of its own); never stored
FORWARD = (Verdict.FORWARD_UNDERFLOW, Verdict.FORWARD_OVERFLOW)
# bf16 keeps 8 significant bits to fp16's 11: its rounding error is about 8x fp16's wherever fp16's
# range is not the limit. Said when bf16's emulated error is more than twice fp16's with a scale.
BF16_WORSE = 2.0
ROOT = "(model)"  # the model's own forward (capture's ROOT_NAME)


@dataclass(frozen=True)
class ModuleEffect:
    """One parameter's or module's gradient in the emulated step against fp32 (``error``: relative L2)."""

    module: str  # the parameter's module (for a parameter: ``name`` holds the parameter)
    error: float | None  # None: its gradient held inf/NaN
    zeroed: int
    nonzero: int
    nonfinite: int
    name: str = ""
    noise: float | None = None  # its fp32 gradient's batch-to-batch noise, same scale as error; None: not measured

    @property
    def over(self) -> bool:
        """Non-finite, or more than TOLERANCE off fp32."""
        return self.error is None or self.error > TOLERANCE

    @property
    def felt(self) -> bool:
        """Over TOLERANCE and, where the noise was measured, more than NOISE_SHARE of it: what training feels."""
        return self.over and (self.error is None or self.noise is None or self.error > NOISE_SHARE * self.noise)


@dataclass(frozen=True)
class Effect:
    """The emulated step at one setting: S = 2^log2_scale, ``keep_fp32`` modules unrounded."""

    log2_scale: int
    keep_fp32: tuple[str, ...]
    error: float | None  # the whole model's weight gradients; None when any held inf/NaN
    zeroed: int
    nonzero: int
    nonfinite: int
    loss_low: bool
    modules: tuple[ModuleEffect, ...]  # in forward order
    params: tuple[ModuleEffect, ...] = ()  # the judged parameters, in forward order
    outputs: tuple[tuple[str, float | None], ...] = ()  # module outputs' errors, as their forwards finished
    noise: float | None = None  # the whole model's batch-to-batch noise; None: not measured (one batch)
    noise_batches: int = 0
    numerically_zero: tuple[str, ...] = ()  # parameters set aside: fp32 gradient zero up to rounding, forward order

    @property
    def culprit(self) -> str | None:
        """Where the error starts: the first module whose output is more than TOLERANCE off fp32's,
        else (an error made in backward only) the module of the last parameter, in forward order,
        that is more than TOLERANCE off: backward carries an error to the parameters before it."""
        for name, error in self.outputs:
            if name != ROOT and (error is None or error > TOLERANCE):
                return name
        over = [p for p in self.params if p.over]
        return over[-1].module if over else None

    @property
    def harmless(self) -> bool:
        """Finite, and every judged parameter within TOLERANCE of fp32."""
        return self.nonfinite == 0 and not any(p.over for p in self.params)

    @property
    def unfelt(self) -> bool:
        """Finite, and no judged parameter's error one training feels: the step raises no alarm (a fix holds)."""
        return self.nonfinite == 0 and self.first_felt is None

    @property
    def first_over(self) -> ModuleEffect | None:
        """The first parameter in forward order more than TOLERANCE off (or non-finite)."""
        return next((p for p in self.params if p.over), None)

    @property
    def first_felt(self) -> ModuleEffect | None:
        """The first parameter in forward order whose error training feels (:attr:`ModuleEffect.felt`)."""
        return next((p for p in self.params if p.felt), None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form kept in the recommendation's evidence (modules: the five worst)."""
        def worst(rows: tuple[ModuleEffect, ...]) -> list[ModuleEffect]:
            return sorted(rows, key=lambda m: -math.inf if m.error is None else -m.error)[:5]

        return {"log2_scale": self.log2_scale, "keep_fp32": list(self.keep_fp32), "error": self.error,
                "zeroed": self.zeroed, "nonzero": self.nonzero, "nonfinite": self.nonfinite,
                "loss_low": self.loss_low,
                "worst_modules": [[m.module, m.error] for m in worst(self.modules)],
                "worst_parameters": [[p.name, p.error, p.noise] for p in worst(self.params)],
                "noise": self.noise, "noise_batches": self.noise_batches,
                "numerically_zero": list(self.numerically_zero)}


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else "(model)"


def effect_at(data: Mapping[str, Any], log2_scale: int, keep: Sequence[str] = (), *,
              batches: int | None = None) -> Effect | None:
    """The emulated step's effect at S = 2^log2_scale with ``keep`` in fp32; None when it was not run.

    Over the most batches it was run on, or over exactly ``batches`` (the neighbours of S run on
    the first batch only; ``batches=1`` sets S beside them on that same batch). Parameters whose
    fp32 gradient is numerically zero (:func:`numerically_zero_rows`, and the names in
    ``data[ZERO_KEY]``) are set aside from the parameters and modules judged, and named in
    :attr:`Effect.numerically_zero`; the whole model's error keeps them (it is what the step measured).
    """
    setting = _setting(data, log2_scale, keep, batches)
    if setting is None:
        return None
    names, rows = _judgeable(data, setting)
    total_ref = sum(float(r[1]) for r in rows)
    nonfinite_all = sum(int(r[4]) for r in rows)
    whole = _whole_error(rows, total_ref, nonfinite_all)
    zero = numerically_zero_rows(names, rows, data.get(UNIT_KEY, data.get("format")), data.get(ZERO_KEY) or ())
    judged_names = [n for n in names if n not in zero]
    judged_rows = [r for n, r in zip(names, rows) if n not in zero]
    noise, whole_noise, k = _noise(data)
    params = [dataclasses.replace(p, noise=noise.get(p.name))
              for p in _param_effects(judged_names, judged_rows, total_ref)]
    modules = _module_effects(judged_names, judged_rows, total_ref)
    outputs = _output_errors(setting)
    return Effect(log2_scale=log2_scale, keep_fp32=tuple(keep), error=whole, outputs=tuple(outputs),
                  zeroed=sum(int(r[2]) for r in rows), nonzero=sum(int(r[3]) for r in rows),
                  nonfinite=nonfinite_all, loss_low=bool(setting.get("loss_low")), modules=tuple(modules),
                  params=tuple(params), noise=whole_noise, noise_batches=k,
                  numerically_zero=tuple(n for n in names if n in zero))


def numerically_zero_rows(names: Sequence[str], rows: Sequence[Any], format: str | torch.dtype | None,
                          also: Sequence[str] = ()) -> frozenset[str]:
    """The parameters whose fp32 gradient is zero up to fp32's own rounding: no error can be judged against it.

    A gradient is a sum (over the batch, the positions, the paths through the graph); where the
    terms cancel in exact arithmetic (an attention key bias: softmax ignores a shift shared by
    every key; a bias before a BatchNorm), each run's computed gradient is its own rounding of
    that sum, a share of its unit roundoff u of the terms' size. Two signs, both needed:

    - fp32's rounding could make it: the target rounds the same sum with u_t (fp16 2^-11, bf16
      2^-8, from ``torch.finfo``), fp32 with u_32 = 2^-24, so fp32's own rounding is about
      ``||g_t - g_32|| * u_32 / u_t``; the gradient is within ROUNDOFF_MARGIN of it when its
      relative error is at least (u_t / u_32) / ROUNDOFF_MARGIN: 512 (51,200%) for fp16, 4096 for
      bf16. Alone this is not enough: where the target's forward is itself broken (bf16's
      E[x^2] - E[x]^2 norm after Linear(bias 4)), a real gradient is 10^4 off too.
    - it is out of scale with its module: its fp32 norm is at least 2^CANCELLED_BITS (2^12) below
      the largest of its module's other parameters' (a key bias 10^-8 of its weight's). A real
      bias that far below its weight needs inputs of 4096 and more; a real gradient with both
      signs needs such inputs and a target error of 512x.

    A cancelled sum the target rounds to exact zeros is 100% off and is not caught here: the
    fp32 histograms see it (:func:`fp16probe.analysis.whatif.numerically_zero`: a bias 2^-12
    below the largest output gradient it sums, fp32's values alone), and their names come in
    ``also``. Names with a non-finite target gradient stay judged.
    """
    dtype: torch.dtype | None = None
    if isinstance(format, torch.dtype):
        dtype = format
    elif format is not None:
        try:
            dtype = get_format(str(format)).dtype
        except ValueError:  # UnknownFormatError: a format with no unit roundoff of its own, the histograms' names alone
            dtype = None
    zero = set(also)
    if dtype is not None:
        line = (torch.finfo(dtype).eps / torch.finfo(torch.float32).eps / ROUNDOFF_MARGIN) ** 2
        by_module: dict[str, list[tuple[str, float]]] = {}
        for n, r in zip(names, rows):
            by_module.setdefault(_module_of(n), []).append((n, float(r[1])))
        for n, r in zip(names, rows):
            ref = float(r[1])
            others = max((x for m, x in by_module[_module_of(n)] if m != n), default=0.0)
            if (r[0] is not None and not r[4] and ref > 0 and float(r[0]) >= line * ref
                    and ref <= 2.0 ** (-2 * CANCELLED_BITS) * others):  # squared norms: 2^-12 in norm
                zero.add(n)
    return frozenset(n for n, r in zip(names, rows) if n in zero and not r[4])


def _noise(data: Mapping[str, Any]) -> tuple[dict[str, float], float | None, int]:
    """Per parameter and over the model, one batch's gradient noise as a share of a batch gradient's RMS norm.

    From ``data["noise"]`` (:mod:`fp16probe.capture.noise`): sqrt(spread / (k - 1) / (square / k)),
    the unbiased sample variance over k batches. ({}, None, 0) without it or with fewer than 2 batches.
    """
    found = data.get("noise")
    if not isinstance(found, Mapping):
        return {}, None, 0
    k = int(found.get("batches") or 0)
    if k < 2:
        return {}, None, 0
    names = list(data.get("parameters") or ())
    rows = list(found.get("params") or ())
    out = {n: math.sqrt(float(a) / (k - 1) / (float(b) / k)) for n, (a, b) in zip(names, rows) if float(b) > 0}
    spread, square = sum(float(r[0]) for r in rows), sum(float(r[1]) for r in rows)
    return out, (math.sqrt(spread / (k - 1) / (square / k)) if square > 0 else None), k


def _setting(data: Mapping[str, Any], log2_scale: int, keep: Sequence[str],
             batches: int | None) -> Mapping[str, Any] | None:
    """The setting run at S with ``keep`` in fp32 (over ``batches``, else the most batches); None without one."""
    found = [s for s in data.get("settings") or ()
             if int(s["log2_scale"]) == log2_scale and sorted(s.get("keep_fp32") or ()) == sorted(keep)
             and (batches is None or int(s.get("batches", 1)) == batches)]
    best: Mapping[str, Any] | None = next(iter(sorted(found, key=lambda s: -int(s.get("batches", 1)))), None)
    return best


def _judgeable(data: Mapping[str, Any], setting: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """The parameters' names and rows ``[error^2, fp32^2, zeroed, nonzero, nonfinite]``, those with a finite fp32 gradient.

    A parameter whose fp32 gradient was not finite cannot be judged against it: left out.
    """
    names = list(data.get("parameters") or ())
    pairs = [(n, r) for n, r in zip(names, setting["params"]) if r[1] is not None]
    return [n for n, _ in pairs], [r for _, r in pairs]


def _relative(err: Any, ref: Any, nonfinite: int) -> float | None:
    """Relative L2 error from squared sums; None when it held inf/NaN, 0 against a zero reference."""
    return None if err is None or nonfinite else (math.sqrt(err / ref) if ref > 0 else 0.0)


def _param_effects(names: list[str], rows: list[Any], total_ref: float) -> list[ModuleEffect]:
    """The judged parameters: those above the noise floor, or with most of their values flushed."""
    params = []
    for name, r in zip(names, rows):
        err, ref, zeroed, nonzero, nonfinite = r
        if nonfinite == 0 and ref <= NOISE_FLOOR**2 * total_ref and zeroed <= ZEROED_COUNTS * nonzero:
            continue
        params.append(ModuleEffect(_module_of(name), _relative(err, ref, nonfinite), int(zeroed), int(nonzero),
                                   int(nonfinite), name))
    return params


def _module_effects(names: list[str], rows: list[Any], total_ref: float) -> list[ModuleEffect]:
    """The parameters' rows summed per module, those above the noise floor, in forward order."""
    by_module: dict[str, list[Any]] = {}
    for name, r in zip(names, rows):
        acc = by_module.setdefault(_module_of(name), [0.0, 0.0, 0, 0, 0])
        acc[0] = None if r[0] is None or acc[0] is None else acc[0] + float(r[0])
        acc[1] += float(r[1])
        acc[2], acc[3], acc[4] = acc[2] + int(r[2]), acc[3] + int(r[3]), acc[4] + int(r[4])
    modules = []
    for module, (err, ref, zeroed, nonzero, nonfinite) in by_module.items():
        if nonfinite == 0 and ref <= NOISE_FLOOR**2 * total_ref:
            continue
        modules.append(ModuleEffect(module, _relative(err, ref, nonfinite), zeroed, nonzero, nonfinite))
    return modules


def _whole_error(rows: list[Any], total_ref: float, nonfinite_all: int) -> float | None:
    """The whole model's relative error; None when any gradient held inf/NaN or the reference is zero."""
    errs = [r[0] for r in rows]
    return (None if nonfinite_all or any(e is None for e in errs) or total_ref <= 0
            else math.sqrt(sum(float(e) for e in errs) / total_ref))


def _output_errors(setting: Mapping[str, Any]) -> list[tuple[str, float | None]]:
    """The module outputs' relative errors, as their forwards finished (a zero reference left out)."""
    outputs = []
    for name, (err_o, ref_o) in setting.get("outputs") or ():  # JSON form: [name, [error^2, fp32^2]]
        if ref_o is None or ref_o <= 0:
            continue
        outputs.append((str(name), None if err_o is None else math.sqrt(err_o / ref_o)))
    return outputs


def _checked_log2(rec: Recommendation) -> int | None:
    """The S a verdict stands on: its own, or for a forward verdict the gradients' verdict's."""
    if rec.verdict in FORWARD:
        k = rec.evidence.get("backward_log2_scale")
        return int(k) if k is not None else None
    if rec.verdict is Verdict.INSUFFICIENT_EVIDENCE or rec.log2_scale is None:
        return None
    return int(rec.log2_scale)


def scales_to_check(rec: Recommendation) -> list[int]:
    """log2 of the scales the emulated step runs at: the verdict's S and its neighbours (x1/2, x2); [0] for no scale."""
    if rec.format == "bf16":
        return [0]
    k = _checked_log2(rec)
    if k is None:
        return []
    return [k] if k == 0 else [k - 1, k, k + 1]


def fixes_to_try(rec: Recommendation, data: Mapping[str, Any]) -> list[list[str]]:
    """Module lists whose kept-in-fp32 step should be measured at the verdict's S before judging.

    A forward verdict's own fix, and for gradients more than TOLERANCE off the first module
    (forward order) where the error appears, and the loss computed in fp32 (``[LOSS]``) when the
    step rounded values outside the model (a loss that computes in the low format).
    """
    k = _checked_log2(rec) if rec.format != "bf16" else 0
    if k is None:
        return []
    out: list[list[str]] = []
    fix = [str(m) for m in rec.evidence.get("fix_modules") or ()]
    if rec.verdict in FORWARD and fix:
        out.append(fix)
    eff = effect_at(data, k)
    if eff is not None and not eff.harmless and eff.nonfinite == 0:
        culprit = eff.culprit
        if culprit is not None and culprit != ROOT and [culprit] not in out:
            out.append([culprit])
        at_k = _setting(data, k, (), None)
        if at_k is not None and int(at_k.get("rounded_outside") or 0) > 0:
            out.append([LOSS])
    return [f for f in out if effect_at(data, k, f) is None]


def judged(rec: Recommendation, data: Mapping[str, Any] | None,
           gradients_only: Recommendation | None = None, any_flush: Recommendation | None = None) -> Recommendation:
    """``rec`` judged by the emulated step in ``data`` (the ``emulation`` section's JSON form, :func:`effect_of`).

    ``no_single_scale`` whose least bad S the step finds within TOLERANCE, its weight gradients zeroed no
    more than the threshold allows, becomes ``constant`` at that S, with the caveat ``flush_no_effect``
    (the flush the histograms count does not reach the gradients it is judged by: a tiny Llama with a
    massive BOS activation, 0.12% flushed at S = 2^19, its real fp16 gradients 0.06% off fp32).
    ``gradients_only`` is the verdict without the forward findings as verdicts (``analyze(...,
    forward_verdicts=False)``): it leads when a forward verdict's effect is within TOLERANCE.
    Adds ``evidence["emulated"]``; a forward finding without effect becomes the caveat
    ``forward_no_effect``. Gradients more than TOLERANCE off with no overflow: where the
    forward flushes (below the share that makes a verdict), ``any_flush`` (``analyze(...,
    forward_underflow_at=0)``, the flush as the verdict) leads, since its effect shows;
    otherwise ``gradient_error`` (also for inf/NaN at S and at S/2: made in the step, not by S;
    inf/NaN at S only gives the caveat ``emulated_overflow``). Without emulation data (or for another format) ``rec`` is returned as it is.
    """
    if data is None or data.get("format") != rec.format:
        return rec
    k = _checked_log2(rec) if rec.format != "bf16" else 0
    if k is None:
        return rec
    eff = effect_at(data, k)
    if eff is None:
        return rec
    emulated = _emulated_evidence(data, eff, k)
    extra = _against_fp16(rec, data, eff, emulated)
    if rec.verdict in FORWARD:
        return _judged_forward(rec, data, eff, k, emulated, extra, gradients_only)
    overflow = _emulated_overflow(data, eff, k)
    if overflow is not None:
        return _with(rec, emulated, (overflow,))
    if rec.verdict is Verdict.NO_SINGLE_SCALE and _flush_unfelt(rec, eff):
        constant = dataclasses.replace(rec, verdict=Verdict.CONSTANT)
        return _with(constant, emulated, extra + (_flush_no_effect(rec, data, eff, k),))
    if not eff.harmless and rec.verdict is not Verdict.INSUFFICIENT_EVIDENCE:
        if any_flush is not None and any_flush.verdict in FORWARD:
            return judged(any_flush, data, gradients_only)
        if eff.nonfinite == 0 and eff.first_felt is None:  # rounding inside the gradients' own noise
            return _with(rec, emulated, extra + (_within_noise(data, eff, k),))
        return _gradient_error(rec, data, eff, k, emulated, extra)
    return _with(rec, emulated, extra)


def _against_fp16(rec: Recommendation, data: Mapping[str, Any], eff: Effect,
                  emulated: dict[str, Any]) -> tuple[Caveat, ...]:
    """For bf16, the fp16 step measured beside it (into ``emulated["fp16"]``); the caveat when bf16 is much worse."""
    fp16 = data.get("fp16")
    if not (rec.format == "bf16" and isinstance(fp16, Mapping) and fp16.get("settings")):
        return ()
    k16 = int(fp16["settings"][0]["log2_scale"])
    other = effect_at(fp16, k16)
    if other is None:
        return ()
    emulated["fp16"] = {**other.to_dict(), "harmless": other.harmless}  # every fp16 parameter within TOLERANCE
    if (eff.error is not None and other.error is not None and other.nonfinite == 0
            and eff.error > BF16_WORSE * other.error):
        return (Caveat("bf16_worse_than_fp16", {"error": eff.error, "fp16_error": other.error,
                                                 "fp16_log2_scale": k16, "target": data.get("target")}),)
    return ()


def _judged_forward(rec: Recommendation, data: Mapping[str, Any], eff: Effect, k: int, emulated: dict[str, Any],
                    extra: tuple[Caveat, ...], gradients_only: Recommendation | None) -> Recommendation:
    """A forward verdict with its fix's step; the gradients' verdict leads when the finding has no effect."""
    fix = [str(m) for m in rec.evidence.get("fix_modules") or ()]
    fixed = effect_at(data, k, fix) if fix else None
    if fixed is not None:
        emulated["fix"] = fixed.to_dict()
    if eff.harmless and gradients_only is not None and gradients_only.verdict not in FORWARD:
        return _with(gradients_only, emulated, (_forward_no_effect(rec, data, eff, k),))
    return _with(rec, emulated, extra)


def _forward_no_effect(rec: Recommendation, data: Mapping[str, Any], eff: Effect, k: int) -> Caveat:
    """The caveat for a forward finding whose emulated gradients are within TOLERANCE: its first tensor."""
    ev: Mapping[str, Any] = rec.evidence
    rows: list[Any] = list(ev.get("forward_overflow" if rec.verdict is Verdict.FORWARD_OVERFLOW
                                  else "forward_flushing") or [])
    first: Mapping[str, Any] = rows[0] if rows else {}
    return Caveat("forward_no_effect", {
        "finding": rec.verdict.value, "tensor": first.get("name"),
        "flushed_fraction": first.get("flushed_fraction"), "max_abs": first.get("max_abs"),
        "error": eff.error, "log2_scale": k, "target": data.get("target"), "regime": data.get("regime"),
        "tolerance": TOLERANCE})


def _flush_unfelt(rec: Recommendation, eff: Effect) -> bool:
    """Whether the flush the histograms count at S reaches the weights: every parameter within TOLERANCE and
    no more of the weight gradients' nonzero values zeroed than the verdict's threshold allows (under Adam a
    zeroed value is a lost update however small: an output weighted 2^-18 in the loss keeps its share of the L2
    norm under 0.1% while its row of the last layer never updates)."""
    tau = float(rec.thresholds.get("max_flushed_fraction", 0.0))
    return eff.harmless and eff.zeroed <= tau * eff.nonzero


def _flush_no_effect(rec: Recommendation, data: Mapping[str, Any], eff: Effect, k: int) -> Caveat:
    """The caveat for ``no_single_scale`` whose least bad S the emulated step finds within TOLERANCE: the
    histograms' flush at S, the modules it is in, and the measured error (the verdict becomes ``constant``)."""
    ev: Mapping[str, Any] = rec.evidence
    return Caveat("flush_no_effect", {
        "flushed_fraction": ev.get("flushed_fraction_at_scale"),
        "threshold": rec.thresholds.get("max_flushed_fraction"),
        "modules": [str(row[0]) for row in ev.get("flushing_modules_at_scale") or ()][:3],
        "error": eff.error, "zeroed": eff.zeroed, "nonzero": eff.nonzero, "log2_scale": k, "tolerance": TOLERANCE,
        "target": data.get("target"), "regime": data.get("regime")})


def _within_noise(data: Mapping[str, Any], eff: Effect, k: int) -> Caveat:
    """The caveat for gradients more than TOLERANCE off whose error is within NOISE_SHARE of their noise: the worst."""
    worst = max((p for p in eff.params if p.over), key=lambda p: (p.error or 0.0) / (p.noise or math.inf))
    return Caveat("error_within_noise", {
        "parameter": worst.name, "error": worst.error, "noise": worst.noise, "model_error": eff.error,
        "model_noise": eff.noise, "noise_batches": eff.noise_batches, "noise_share": NOISE_SHARE,
        "tolerance": TOLERANCE, "ambiguous_share": AMBIGUOUS_SHARE, "log2_scale": k, "target": data.get("target"),
        "format": data.get("format")})


def _emulated_overflow(data: Mapping[str, Any], eff: Effect, k: int) -> Caveat | None:
    """The caveat when the step overflows at S and not at S/2; None otherwise.

    The histograms' S overflows in the emulated step where half of it does not: a gradient
    the overflow ceiling did not see. Said, not hidden; the S stays the histograms'.
    """
    below = effect_at(data, k - 1) if k else None
    if not (eff.nonfinite and below is not None and below.nonfinite == 0):
        return None
    return Caveat("emulated_overflow", {"log2_scale": k, "nonfinite": eff.nonfinite,
                                        "error_below": below.error, "target": data.get("target"),
                                        "regime": data.get("regime")})


def _gradient_error(rec: Recommendation, data: Mapping[str, Any], eff: Effect, k: int,
                    emulated: dict[str, Any], extra: tuple[Caveat, ...] = ()) -> Recommendation:
    """The verdict ``gradient_error``: where the error starts, its kept-in-fp32 step, and the modules to keep.

    The fix (``fix_modules``, ``fix_device``) is given only when that step holds: it raises no alarm, every
    judged parameter within TOLERANCE or NOISE_SHARE of its noise (:attr:`Effect.unfelt`, the line the alarm
    itself is judged by: the bf16 KL student of docs/evidence.md, 15.6% off with its loss in fp32 against
    noise of 84%, trains inside fp32's band that way). A fix
    the measurement refutes is reported as measured (``emulated["fix_holds"]``), never offered. Where the
    step also ran with the loss computed in fp32 (``emulated["loss_fix"]``, ``["loss_fix_holds"]``), that
    fix is offered in words when it holds (``fix_loss``): it is the user's code, not a module to keep.
    """
    over = eff.first_felt
    culprit = eff.culprit or ROOT
    assert over is not None
    fixed = effect_at(data, k, [culprit])
    holds = fixed is not None and culprit != ROOT and fixed.unfelt
    if fixed is not None:
        emulated["fix"] = fixed.to_dict()
        emulated["fix_holds"] = holds
    loss_fixed = effect_at(data, k, [LOSS])
    if loss_fixed is not None:
        emulated["loss_fix"] = loss_fixed.to_dict()
        emulated["loss_fix_holds"] = loss_fixed.unfelt
    emulated["module"] = culprit
    out_error = dict(eff.outputs).get(culprit)  # kept where the error starts in the forward, else made in backward
    emulated["module_output_error"] = out_error if out_error is not None and out_error > TOLERANCE else None
    emulated["first_parameter"] = over.name
    emulated["first_parameter_error"] = over.error
    emulated["first_parameter_noise"] = over.noise
    out = _with(rec, emulated, extra)  # under bf16, the fp16 comparison stays with the alarm
    ev = dict(out.evidence)
    ev["backward_verdict"] = rec.verdict.value
    ev["backward_log2_scale"] = rec.log2_scale
    ev["fix_modules"] = [culprit] if holds else []
    ev["fix_loss"] = loss_fixed is not None and loss_fixed.unfelt
    ev["fix_device"] = data.get("target") or "cuda"  # the code is presentation's, from these checked tokens
    return dataclasses.replace(out, verdict=Verdict.GRADIENT_ERROR, evidence=ev)  # type: ignore[arg-type]


def _emulated_evidence(data: Mapping[str, Any], eff: Effect, k: int) -> dict[str, Any]:
    around = []  # S and its neighbours on the first batch, where all three ran
    for j in (k - 1, k, k + 1):
        e = effect_at(data, j, batches=1)
        if e is not None:
            around.append([j, e.error, e.nonfinite])
    if len(around) < 2:
        around = []
    return {**eff.to_dict(), "target": data.get("target"), "regime": data.get("regime"),
            "batches": data.get("batches"), "tolerance": TOLERANCE, "noise_share": NOISE_SHARE, "neighbours": around,
            "source": data.get("source")}


def _with(rec: Recommendation, emulated: Mapping[str, Any], caveats: tuple[Caveat, ...] = ()) -> Recommendation:
    ev = dict(rec.evidence)
    ev["emulated"] = dict(emulated)
    return dataclasses.replace(rec, evidence=ev, caveats=rec.caveats + caveats)  # type: ignore[arg-type]


def judge_report(report: Report, format: str | Format | None = None, *, kind: str | None = None,
                 target: str | None = None) -> Recommendation:
    """``analyze(report, format, kind=...)`` judged by the report's emulation section, when it has one.

    What ``fp16probe profile`` gives, again from the saved report alone (``recommend``, ``show``):
    the emulated step's numbers are the report's, measured at the S of the profile's verdict, so
    a re-analysis for another S or format finds no emulated step to judge by and stays the
    histograms' verdict.
    """
    from fp16probe.analysis.recommend import analyze

    return rejudge(report, analyze(report, format, kind=kind, target=target), format, kind=kind, target=target)


def rejudge(report: Report, rec: Recommendation, format: str | Format | None = None, *, kind: str | None = None,
            target: str | None = None) -> Recommendation:
    """``rec``, the histograms' verdict on ``report`` (``analyze``'s, for ``format``), judged by the report's
    emulation section, when it has one: what :func:`judge_report` does once the verdict is at hand."""
    from fp16probe.analysis.recommend import analyze

    data = with_zeros(report, effect_of(report, format if isinstance(format, Format) else None))
    if data is None or data.get("format") != rec.format:
        return rec
    k = _checked_log2(rec) if rec.format != "bf16" else 0
    eff = effect_at(data, k) if k is not None else None
    if eff is None:
        return rec
    gradients_only = any_flush = None
    again = format if isinstance(format, Format) else rec.format  # the caller's Format: no second lookup
    if rec.verdict in FORWARD:
        gradients_only = analyze(report, again, kind=kind, target=target, forward_verdicts=False)
    elif not eff.harmless:
        any_flush = analyze(report, again, kind=kind, target=target, forward_underflow_at=0.0)
    return judged(rec, data, gradients_only, any_flush)


def with_zeros(report: Report, data: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``data`` with the biases the report's fp32 histograms call numerically zero under ZERO_KEY (``data`` itself
    when there are none): :func:`numerically_zero_rows` sets them aside with its own."""
    zero = sorted(numerically_zero(report)) if data is not None else []
    return {**data, ZERO_KEY: zero} if data is not None and zero else data


def effect_of(report: Report, fmt: Format | None = None) -> Mapping[str, Any] | None:
    """The emulation data a report carries (its ``emulation`` section, JSON form), None without a finished pass.

    ``fmt``: the Format the caller resolved, when it is the data's; its dtype goes with the data (``UNIT_KEY``),
    otherwise the stored name is resolved here, once for every :func:`effect_at` that judges this data.
    """
    section = report.section("emulation")
    if section is None or section.error is not None:
        return None
    data: dict[str, Any] = section.to_dict()
    if fmt is not None and fmt.name == data.get("format"):
        data[UNIT_KEY] = fmt.dtype
        return data
    try:
        data[UNIT_KEY] = get_format(str(data.get("format"))).dtype
    except ValueError:  # UnknownFormatError: no unit roundoff of its own; the histograms' names alone
        data[UNIT_KEY] = None
    return data
