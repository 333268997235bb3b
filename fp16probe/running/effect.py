"""The profile's emulation pass: the target's step emulated on a few profiled batches, then the verdict judged by it.

After the profile's run and its histogram verdict, :func:`with_effect` steps the model (its
weights at the end of the run) on the first :data:`EMULATED_BATCHES` batches, emulated as the
target run computes (:mod:`fp16probe.capture.emulate`) at the verdict's S (its neighbours on the
first batch),
against fp32 steps of the same weights and batches; measures the kept-in-fp32 fix the verdict
names; stores the numbers in the report's ``emulation`` section; and re-judges the verdict by
them (:func:`fp16probe.analysis.effect.judged`). A failure of the pass (an op the emulation
cannot follow) is noted in the report and leaves the histogram verdict as it was.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fp16probe.analysis.effect import UNIT_KEY, fixes_to_try, rejudge, scales_to_check, with_zeros
from fp16probe.analysis.forward import FP16_LOSS_LOG2_CAP
from fp16probe.analysis.recommend import analyze
from fp16probe.emulation import Emulation
from fp16probe.formats import Format
from fp16probe.recommendation import Verdict
from fp16probe.report import Report
from fp16probe.running.inputs import call_model
from fp16probe.running.losses import Loss

__all__ = ["EMULATED_BATCHES", "KEPT_BATCHES", "NOISE_BATCHES", "loss_generators", "with_effect"]

# S/2, S and 2S run on the first batch, S on the others, each fix on all: with 2 batches, 2 fp32 and
# 4 emulated steps (GPT-2 small from its config on this CPU: 60 s -> 87 s for a 10-step profile).
EMULATED_BATCHES = 2
# The fp32 gradients' batch-to-batch noise (fp16probe.capture.noise) over up to this many of the profile's
# batches: 4 fp32 steps more, cheap beside the emulated ones; 2 is the least that measures a spread.
NOISE_BATCHES = 4
KEPT_BATCHES = max(EMULATED_BATCHES, NOISE_BATCHES)  # the batches the profile keeps for this pass


def loss_generators(obj: Any, depth: int = 0) -> list[torch.Generator]:
    """The torch.Generator objects a loss keeps (the invented labels' own), a few attributes deep."""
    if isinstance(obj, torch.Generator):
        return [obj]
    if depth >= 3 or isinstance(obj, (torch.Tensor, nn.Module, str, bytes, int, float)):
        return []
    if isinstance(obj, dict):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    else:
        values = list(getattr(obj, "__dict__", {}).values())
    return [g for v in values for g in loss_generators(v, depth + 1)]


def _runs(model: nn.Module, batches: Sequence[Any], loss: Loss) -> list[Callable[[], torch.Tensor]]:
    """One call per batch making its loss; a loss that draws its own labels draws the same ones on every call,
    so the fp32 and the emulated steps of a batch compare gradients of one loss."""
    gens = loss_generators(loss.fn)
    states = [g.get_state() for g in gens]

    def run(batch: Any) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            for g, s in zip(gens, states):
                g.set_state(s)
            return loss.fn(call_model(model, batch), batch).reshape(())

        return call

    return [run(b) for b in batches]


def _loss_fp16_found(report: Report, data: dict[str, Any], target: str) -> Report | None:
    """``report`` with the forward audit's ``loss_fp16_on`` gaining ``target`` when the emulated step held the loss
    in the low format (``data``: fp16's, or bf16's for the fp16 comparison beside it) and the audit had not, and
    that changes the fp16 verdict's S (``report``'s recommendation, above the cap); None otherwise.

    The audit runs the model in fp32 and asks autocast's dispatch what each op would do; a loss that reads
    the autocast state to pick its own precision (``torch.get_autocast_dtype``) computes in fp32 there, and in
    fp16 in the emulated step, which answers that state as the target run would. Its seed gradient is then S
    as an fp16 number: inf from S = 65520, so the verdict's S is capped (``loss_fp16`` caveat).
    """
    rec = report.recommendation
    section = report.forward
    audit = None if section is None else section.audit
    if (rec is None or rec.format != "fp16" or rec.log2_scale is None or rec.log2_scale <= FP16_LOSS_LOG2_CAP
            or not isinstance(audit, Mapping) or not any(st.get("loss_low") for st in data.get("settings") or ())):
        return None
    on = [str(t) for t in audit.get("loss_fp16_on") or ()]
    if target in on:
        return None
    assert section is not None
    found = {**audit, "loss_fp16_on": sorted({*on, target}), "loss_fp16_seen_by": "the emulated step"}
    return report.with_sections({"forward": dataclasses.replace(section, audit=found)})


def with_effect(report: Report, model: nn.Module, batches: Sequence[Any], loss: Loss, *,
                target: str, regime: str, kind: str, fmt: Format | None = None) -> Report:
    """``report`` with the emulation pass's numbers and its verdict judged by them (see the module docstring).

    ``fmt``: the verdict's format as the caller resolved it (else its name is looked up here).
    """
    from fp16probe.capture.emulate import measure_effect, merged_setting
    from fp16probe.capture.noise import measure_noise

    rec = report.recommendation
    if rec is None or rec.format not in ("fp16", "bf16") or not batches:
        return report
    scales = scales_to_check(rec)
    if not scales:
        return report
    runs = _runs(model, batches[:EMULATED_BATCHES], loss)
    began = time.perf_counter()
    try:
        k = scales[len(scales) // 2]
        # S and its neighbours on the first batch (so they compare like with like), S alone on the others,
        # and S over all of them: a third less time than every scale on every batch (GPT-2 small)
        data = measure_effect(model, runs[:1], format=rec.format, target=target, regime=regime,
                              settings=[(j, ()) for j in scales])
        audited = _loss_fp16_found(report, data, target)
        if audited is not None:  # the loss is fp16 in the target run, which the audit did not see: S capped
            report = audited
            rec = analyze(report, fmt if fmt is not None else rec.format, kind=kind)
            scales = scales_to_check(rec)  # the capped S and its neighbours
            k = scales[len(scales) // 2]
            data = measure_effect(model, runs[:1], format=rec.format, target=target, regime=regime,
                                  settings=[(j, ()) for j in scales])
        if len(runs) > 1:
            rest = measure_effect(model, runs[1:], format=rec.format, target=target, regime=regime,
                                  settings=[(k, ())])
            first = next(s for s in data["settings"] if s["log2_scale"] == k)
            data["settings"].append(merged_setting(first, rest["settings"][0]))
            data["batches"] = len(runs)
        if rec.format == "bf16":  # bf16 needs no scale for its range; its precision is set beside fp16's at its S
            fp16 = analyze(report, "fp16", kind=kind, target=target)
            seen = _loss_fp16_found(report.with_recommendation(fp16), data, target)
            if seen is not None:  # a loss held in bf16 is held in fp16 in an fp16 run: its S is capped there
                report = seen.with_recommendation(rec)
                fp16 = analyze(report, "fp16", kind=kind, target=target)
            k16 = fp16.log2_scale if fp16.verdict in (Verdict.NONE_NEEDED, Verdict.CONSTANT, Verdict.DYNAMIC) else None
            if k16 is not None:
                data["fp16"] = measure_effect(model, runs, format="fp16", target=target, regime=regime,
                                              settings=[(int(k16), ())])
        if len(batches) > 1:  # one batch has no spread: the judgement then says the noise is not measured
            data["noise"] = measure_noise(model, _runs(model, batches[:NOISE_BATCHES], loss), data["parameters"])
        judging = dict(with_zeros(report, data) or data)
        if fmt is not None and fmt.name == rec.format:  # the Format at hand: its name is not looked up again
            judging[UNIT_KEY] = fmt.dtype
        for fix in fixes_to_try(rec, judging):
            more = measure_effect(model, runs, format=rec.format, target=target, regime=regime,
                                  settings=[(k, fix)])
            data["settings"] += more["settings"]
    except Exception as e:  # the emulation must never cost the user the profile
        why = (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]
        return report.with_sections({"emulation": Emulation(error=why)})
    data["seconds"] = round(time.perf_counter() - began, 3)
    report = report.with_sections({"emulation": Emulation.from_dict(data)})
    judged_as = fmt if fmt is not None and fmt.name == rec.format else rec.format
    # rec is the profile's analysis of this report: judged again by the emulation, not analysed twice
    return report.with_recommendation(rejudge(report, rec, judged_as, kind=kind, target=target))

