"""Merge a Probe's statistics across torch.distributed ranks into one Report.

Each rank captures locally. :func:`gather_report` brings every rank's report to one
rank in a single ``gather_object`` call and merges them there: counts add up, maxima
take the max. Activation gradients are local to a rank (its own micro-batch) and sum.
Weight gradients are different under DDP: after backward they are all-reduced, the same
on every rank, and counting them once per rank would multiply them by the world size.
The Probe reads them after DDP's all-reduce (:func:`after_backward`), so every rank
holds the same weight-gradient histograms and the merge keeps one copy of them. Under
FSDP2 (``fully_shard``) each parameter's gradient is a DTensor; the Probe reads each rank's
local shard (``to_local()``), marks the report as sharded, and the shards' counts add up
(the max is the max). Empty weight gradients on every rank are never taken as "identical".

Contract for launchers (the CLI under torchrun)::

    init_from_env()                  # join the group torchrun describes; False when alone
    report = gather_report(probe)    # every rank calls it; a Report on rank 0, None elsewhere
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from fp16probe.errors import Fp16ProbeError
from fp16probe.report import (
    ACTIVATION,
    WEIGHT_GRAD,
    Histogram,
    Report,
    StepTrace,
    merge_ceilings,
    merge_histories,
    merge_reports,
    with_workload,
)
from fp16probe.sections import CaptureNotes

__all__ = [
    "WEIGHT_GRAD_MERGES",
    "after_backward",
    "gather_report",
    "init_from_env",
    "is_distributed",
    "merge_rank_reports",
    "rank",
    "world_size",
]

WEIGHT_GRAD_MERGES = ("auto", "replicated", "sharded")


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def is_distributed() -> bool:
    """Whether a torch.distributed process group of more than one rank is running."""
    dist = _dist()
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def rank() -> int:
    """This process's rank (0 when not distributed)."""
    dist = _dist()
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 when not distributed)."""
    dist = _dist()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def init_from_env(backend: str | None = None, timeout: float | None = None) -> bool:
    """Join the process group that torchrun describes in the environment.

    Returns whether the run is distributed. Without ``WORLD_SIZE`` > 1 in the environment
    nothing happens. The backend defaults to nccl when CUDA is available, else gloo.
    ``timeout`` (seconds) bounds every collective's wait for the other ranks, so that a
    rank that died or hangs stops the others (torch's own default is 10 or 30 minutes).
    """
    if is_distributed():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist = _dist()
    if not dist.is_available():
        raise Fp16ProbeError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} asks for a distributed run, but this torch build has "
            "no torch.distributed; run a single process or install a torch with distributed support"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if timeout is None:
        dist.init_process_group(backend)
    else:
        from datetime import timedelta

        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return world_size() > 1


def after_backward(fn: Callable[[], None], *, ddp: bool = True) -> None:
    """Run ``fn`` once the current backward pass is over (with ``ddp``, after DDP has all-reduced).

    Call it from inside backward (an autograd hook). DDP queues its own end-of-backward
    callback (which waits for the bucket all-reduces and writes the averaged gradients)
    only when its last bucket is ready, so a callback queued now would run before it.
    The engine runs callbacks queued by a callback after all those already queued, so
    queueing from a callback puts ``fn`` after DDP's.
    """
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback((lambda: engine.queue_callback(fn)) if ddp else fn)


def gather_report(
    probe_or_report: Any,
    *,
    dst: int = 0,
    weight_grads: str = "auto",
    group: Any = None,
    partial: bool = False,
    extra: dict[str, Any] | None = None,
) -> Report | None:
    """Merge every rank's statistics into one Report on rank ``dst``; None on other ranks.

    Every rank must call it (it is a collective). Takes a Probe (its report is made here,
    with ``partial``/``extra``) or a Report. Not distributed: returns the local report.
    ``weight_grads`` says how weight gradients combine: ``"replicated"`` (DDP: keep one
    rank's), ``"sharded"`` (FSDP: sum the shards) or ``"auto"`` (replicated when every
    rank saw the same weight gradients, else summed). One ``gather_object`` per call;
    it synchronises with the device and the other ranks, so call it after training.
    """
    if weight_grads not in WEIGHT_GRAD_MERGES:
        raise Fp16ProbeError(f"weight_grads must be one of {WEIGHT_GRAD_MERGES}, got {weight_grads!r}")
    if isinstance(probe_or_report, Report):
        report = probe_or_report
    elif hasattr(probe_or_report, "report"):
        report = probe_or_report.report(partial=partial, extra=extra)
    else:
        raise Fp16ProbeError(
            f"gather_report needs a Probe or a Report, got {type(probe_or_report).__name__}"
        )
    report = with_workload(report)  # a Report made elsewhere: the run's description out of metadata.extra
    if not is_distributed():
        return report
    dist = _dist()
    me = dist.get_rank(group)
    size = dist.get_world_size(group)
    # Plain dicts pickle the same on every torch version; the Report rebuilds and checks them.
    gathered: list[Any] | None = [None] * size if me == dst else None
    dist.gather_object(report.to_dict(), gathered, dst=dst, group=group)
    if me != dst:
        return None
    reports = [Report.from_dict(d, source=f"rank {r}") for r, d in enumerate(gathered)]
    return merge_rank_reports(reports, weight_grads=weight_grads)


def merge_rank_reports(reports: Sequence[Report], *, weight_grads: str = "auto") -> Report:
    """Merge the reports of the ranks of one run (rank order) into one Report."""
    if weight_grads not in WEIGHT_GRAD_MERGES:
        raise Fp16ProbeError(f"weight_grads must be one of {WEIGHT_GRAD_MERGES}, got {weight_grads!r}")
    if not reports:
        raise Fp16ProbeError("merge_rank_reports got no reports; pass one report per rank")
    steps = reports[0].trace.steps
    for r, rep in enumerate(reports):
        if rep.trace.steps != steps:
            raise Fp16ProbeError(
                f"rank {r} recorded steps {list(rep.trace.steps)[:8]}, rank 0 {list(steps)[:8]}: the ranks "
                "did not step together; call probe.step() once per optimizer step on every rank"
            )
    local = merge_reports([_only(rep, keep_weight=False) for rep in reports], how="ranks")
    weights = [_only(rep, keep_weight=True) for rep in reports]
    # Nothing on every rank is no evidence of replication (FSDP2 once lost every weight
    # gradient and the merge called the empty reports identical).
    any_values = any(m.histogram.total > 0 for w in weights for m in w.modules)
    sharded = any(rep.capture is not None and rep.capture.weight_grads_sharded for rep in reports)
    identical: bool | None = (
        all(_weight_view(w) == _weight_view(weights[0]) for w in weights[1:]) if any_values else None
    )
    if weight_grads != "auto":
        how = weight_grads
    elif sharded or not identical:  # DTensor shards (FSDP2) always add up
        how = "sharded"
    else:
        how = "replicated"
    weight = weights[0] if how == "replicated" else merge_reports(weights, how="ranks")

    histograms = dict(local.trace.histograms)
    module_max = dict(local.trace.module_max)
    if WEIGHT_GRAD in weight.trace.histograms:
        histograms[WEIGHT_GRAD] = weight.trace.histograms[WEIGHT_GRAD]
    if WEIGHT_GRAD in weight.trace.module_max:
        module_max[WEIGHT_GRAD] = weight.trace.module_max[WEIGHT_GRAD]
    n = len(steps)
    # As the Probe does: a step found inf when any gradient (not a forward value) held inf or NaN.
    found_inf = tuple(
        any(hs[i].nonfinite > 0 for k, hs in histograms.items() if k != ACTIVATION) for i in range(n)
    )
    trace = StepTrace(
        steps=steps,
        histograms=histograms,
        module_max=module_max,
        scale=reports[0].trace.scale,
        found_inf=found_inf,
        ceiling=merge_ceilings([rep.trace for rep in reports]),
    )
    first = reports[0].metadata
    errors = sum(rep.capture.hook_errors for rep in reports if rep.capture is not None)
    metadata = replace(
        local.metadata,
        world_size=sum(rep.metadata.world_size for rep in reports),
        captured=first.captured,
        extra=dict(first.extra),
    )
    modules = tuple(m for m in local.modules) + tuple(m for m in weight.modules)
    # The other sections as rank 0 saw them, its capture notes with every rank's hook errors.
    head = reports[0]
    capture = replace(head.capture or CaptureNotes(), hook_errors=errors, weight_grad_merge=how,
                      weight_grads_identical_across_ranks=identical)
    return Report(metadata=metadata, modules=modules, trace=trace,
                  history=merge_histories([rep.history for rep in reports]), forward=head.forward,
                  blocks=head.blocks, shadow_runs=head.shadow_runs, capture=capture, workload=head.workload,
                  sections=head.sections, shadow=_merged_shadows(reports))


def _merged_shadows(reports: Sequence[Report]) -> Report | None:
    """The ranks' fp32 reruns merged as their live reports are (each rank reran its own batch, the same steps).

    None unless every rank reran the same steps: a reference for some ranks' batches only would not
    match the merged live counts. Under DDP the reruns hold no weight gradients (capture/shadow.py).
    """
    shadows = [rep.shadow for rep in reports]
    if any(sh is None for sh in shadows):
        return None
    steps = shadows[0].trace.steps  # type: ignore[union-attr]
    if any(sh.trace.steps != steps for sh in shadows):  # type: ignore[union-attr]
        return None
    return merge_rank_reports(shadows)  # type: ignore[arg-type]


def _only(report: Report, *, keep_weight: bool) -> Report:
    """The part of a report with (or without) its weight gradients."""
    def keep(kind: str) -> bool:
        return (kind == WEIGHT_GRAD) == keep_weight

    trace = report.trace
    return replace(
        report,
        modules=tuple(m for m in report.modules if keep(m.kind)),
        trace=replace(
            trace,
            histograms={k: v for k, v in trace.histograms.items() if keep(k)},
            module_max={k: v for k, v in trace.module_max.items() if keep(k)},
        ),
    )


def _weight_view(report: Report) -> tuple[Any, ...]:
    """What must match for weight gradients to count as replicated on every rank."""
    modules = tuple(sorted(((m.name, m.histogram) for m in report.modules), key=lambda nm: nm[0]))
    per_step: tuple[Histogram, ...] = tuple(report.trace.histograms.get(WEIGHT_GRAD, ()))
    return modules, per_step
