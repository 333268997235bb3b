"""Collect the scaled-format statistics (:mod:`fp16probe.capture.blockstats`) of a model's GEMM operands.

For every Linear-like module (``nn.Linear`` and Hugging Face's ``Conv1D``, whose weight is
stored transposed): its input and weight (the forward GEMM), its output gradient (both
backward GEMMs) and its weight gradient. Each tensor is counted in rows (blocks along the
GEMM's reduction dimension) and, for the backward's transposed reads, columns.

Counts stay in device tensors, added in place, with no host synchronisation; the per-step
amax trace is a list of device scalars. :meth:`BlockCapture.collect` brings everything to
the host once, as the JSON that :class:`fp16probe.blockscale.BlockStats` reads.

Off unless a scaled format is asked for (``Probe(block_formats=...)``): with it off the
Probe registers nothing of this module, so fp16 and bf16 runs pay nothing.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fp16probe.capture.compiled import tracing
from fp16probe.blockscale import BLOCK_KINDS, ELEMENTS, FAMILIES, RELATIVE_BINS, BlockStats, DelayedRecipe
from fp16probe.capture import blockstats
from fp16probe.capture.collector import Collected, Collector

__all__ = ["BlockCapture", "layouts_for"]

# NVFP4 variants counted: (name, block scale rule, 16x16 tiles, columns).
NV_VARIANTS = (("1x16", "torchao", False, False), ("1x16_cast", "cast", False, False),
               ("16x16", "torchao", True, False), ("1x16_t", "torchao", False, True),
               ("1x16_cast_t", "cast", False, True))


def layouts_for(families: Iterable[str]) -> tuple[str, ...]:
    """The relative-histogram layouts the families need (MX: 1x32 rows and columns; FP8: tiles and rows)."""
    out: list[str] = []
    fam = set(families)
    if "mx" in fam:
        out += ["mx32", "mx32_t"]
    if "fp8" in fam:
        out += ["tile128", "tile128_t", "tile128x128", "row"]
    return tuple(out)


class _Slot:
    """The device-side counts of one (module, kind) tensor."""

    def __init__(self, layouts: Sequence[str], families: set[str], delayed: Sequence[DelayedRecipe],
                 device: torch.device) -> None:
        z = torch.zeros
        self.device = device
        self.relative = {lay: z(RELATIVE_BINS, dtype=torch.int64, device=device) for lay in layouts}
        self.extra = {lay: z(3, dtype=torch.int64, device=device) for lay in layouts}
        self.spread = {lay: z(blockstats.SPREAD_BINS, dtype=torch.int64, device=device) for lay in layouts}
        self.current = z(2, 4, dtype=torch.int64, device=device) if "fp8" in families else None
        self.delayed = z(len(delayed), 2, 4, dtype=torch.int64, device=device) if delayed else None
        self.history = [z(r.history_len, device=device) for r in delayed]
        self.scales = torch.ones(len(delayed), 2, device=device)  # TE's initial scale, per recipe and element
        self.nvfp4 = z(len(NV_VARIANTS), 6, dtype=torch.int64, device=device) if "nvfp4" in families else None
        self.sr = z(len(NV_VARIANTS), dtype=torch.float64, device=device) if "nvfp4" in families else None
        self.step_amax: torch.Tensor | None = None
        self.trace: list[torch.Tensor] = []
        self.shape: tuple[int, ...] = ()
        self.calls = 0


class BlockCapture(Collector):
    """Hooks that count scaled-format statistics for the Linear-like modules of ``model``.

    ``families`` picks what is counted: ``"mx"`` (MXFP8 blocks of 32, rows and columns),
    ``"fp8"`` (current and delayed per-tensor scaling, rows, 1x128 and 128x128 tiles),
    ``"nvfp4"`` (16-element blocks, two-level scale). ``delayed`` lists the delayed-scaling
    recipes counted live (their scale comes from the device-side amax window, so the counts
    are exact); the amax trace lets any other history length or margin be replayed for scales.
    ``sampling`` says whether the current step is recorded; ``inv_scale(device)`` returns the
    loss scale's inverse (or None) so scaled gradients are counted unscaled.
    """

    key = "blocks"

    def __init__(self, model: nn.Module, families: Iterable[str], *, modules: Sequence[str] = (),
                 delayed: Sequence[DelayedRecipe] = (DelayedRecipe(),),
                 sampling: Callable[[], bool] = lambda: True,
                 inv_scale: Callable[[torch.device], torch.Tensor | None] = lambda d: None) -> None:
        self.families = set(families)
        unknown = self.families - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown block-format families {sorted(unknown)}: expected {', '.join(FAMILIES)}")
        self.model = model
        self.layouts = layouts_for(self.families)
        self.delayed = tuple(delayed) if "fp8" in self.families else ()
        self._patterns = list(modules)
        self._sampling = sampling
        self._inv_scale = inv_scale
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._types: dict[str, str] = {}
        self._handles: list[Any] = []
        self.errors = 0
        self.steps = 0
        self._step_has_data = False

    # -- hooks ---------------------------------------------------------------------
    def _linear_modules(self) -> list[tuple[str, nn.Module]]:
        out = []
        for name, m in self.model.named_modules():
            if not (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"):
                continue
            if not isinstance(getattr(m, "weight", None), torch.Tensor) or m.weight.dim() != 2:
                continue
            if self._patterns and not any(fnmatch.fnmatchcase(name, p) for p in self._patterns):
                continue
            out.append((name, m))
        return out

    def start(self) -> None:
        """Register the hooks (forward on each Linear-like module, accumulate-grad on its weight)."""
        for name, m in self._linear_modules():
            self._types[name] = type(m).__name__
            transposed = type(m).__name__ == "Conv1D"  # weight [in, out]: its rows are the output features
            self._handles.append(m.register_forward_hook(self._forward_hook(name, transposed)))
            if m.weight.requires_grad:
                self._handles.append(m.weight.register_post_accumulate_grad_hook(self._grad_hook(name, transposed)))

    def stop(self) -> None:
        """Remove every hook; the counts stay for :meth:`collect`."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()

    def _forward_hook(self, name: str, transposed: bool):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if tracing() or not self._sampling():  # inside torch.compile: leave the compiled program as it is
                return
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is not None and x.is_floating_point():
                self._count(name, "input", x)
            w = module.weight
            self._count(name, "weight", w.t() if transposed else w)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._output_grad_hook(name))

        return hook

    def _output_grad_hook(self, name: str):
        def hook(g: torch.Tensor) -> None:
            self._count(name, "output_grad", g, scaled=True)

        return hook

    def _grad_hook(self, name: str, transposed: bool):
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None and self._sampling():
                self._count(name, "weight_grad", p.grad.t() if transposed else p.grad, scaled=True)

        return hook

    # -- counting ------------------------------------------------------------------
    def _count(self, name: str, kind: str, x: torch.Tensor, *, scaled: bool = False) -> None:
        """Count ``x`` into its slot; a failure warns and carries on (never breaks training)."""
        try:
            with torch.no_grad():
                self._count_into(name, kind, x.detach(), scaled)
        except Exception as e:  # a bookkeeping failure must not stop a training run
            self.errors += 1
            if self.errors == 1:
                warnings.warn(f"fp16probe: block-format statistics of {name} ({kind}) failed: {e}", stacklevel=2)

    def _count_into(self, name: str, kind: str, x: torch.Tensor, scaled: bool) -> None:
        slot = self._slots.get((name, kind))
        if slot is None:
            slot = self._slots[(name, kind)] = _Slot(self.layouts, self.families, self.delayed, x.device)
        slot.shape = tuple(x.shape)
        slot.calls += 1
        self._step_has_data = True
        x = x.float()
        if scaled:
            inv = self._inv_scale(x.device)
            if inv is not None:
                x = x * inv
        if self.layouts:
            extras = blockstats.relative_histograms(x, self.layouts, slot.relative, slot.spread)
            for lay in self.layouts:
                slot.extra[lay] += extras[lay]
        a = x.abs()
        amax = torch.where(torch.isfinite(a), a, torch.zeros((), device=a.device)).amax()
        slot.step_amax = amax if slot.step_amax is None else torch.maximum(slot.step_amax, amax)
        if slot.current is not None:
            for i, el in enumerate(("e4m3", "e5m2")):
                slot.current[i] += blockstats.current_scaling_counts(x, el)
        if slot.delayed is not None:
            for r in range(len(self.delayed)):
                for i, el in enumerate(("e4m3", "e5m2")):
                    slot.delayed[r, i] += blockstats.scaled_counts(x, slot.scales[r, i], el)
        if slot.nvfp4 is not None and slot.sr is not None:
            for i, (_, rule, square, transposed) in enumerate(NV_VARIANTS):
                counts, sr = blockstats.nvfp4_counts(x, block_scale=rule, square=square, transposed=transposed)
                slot.nvfp4[i] += counts
                slot.sr[i] += sr

    def close_step(self, sampled: bool = True) -> None:
        """End a step: each tensor's amax joins its trace and its delayed-scaling windows."""
        if not self._step_has_data:
            return
        self.steps += 1
        self._step_has_data = False
        for slot in self._slots.values():
            amax = slot.step_amax if slot.step_amax is not None else torch.zeros((), device=slot.device)
            slot.trace.append(amax)
            for r, (hist, recipe) in enumerate(zip(slot.history, self.delayed)):
                hist = slot.history[r] = torch.cat([amax.reshape(1), hist[:-1]])  # newest first, as TE rolls it
                _update_scales(slot.scales[r], hist, recipe)
            slot.step_amax = None

    # -- report --------------------------------------------------------------------
    def collect(self, got: Collected | None = None) -> dict[str, Any]:
        """The report's ``blocks`` section (see :meth:`counts`)."""
        return {"blocks": BlockStats.from_dict(self.counts())}

    def counts(self) -> dict[str, Any]:
        """Bring the counts to the host (one transfer per tensor), as the JSON of :class:`BlockStats`.

        A step still open is included in the counts and, as its own entry, in the trace.
        This synchronises with the device.
        """
        tensors = []
        for (name, kind), slot in self._slots.items():
            trace = list(slot.trace)
            if slot.step_amax is not None:
                trace.append(slot.step_amax)
            entry: dict[str, Any] = {
                "module": name, "type": self._types.get(name, ""), "kind": kind, "shape": list(slot.shape),
                "calls": slot.calls,
                "amax_trace": [float(v) for v in torch.stack(trace).cpu().tolist()] if trace else [],
                "relative": {},
            }
            for lay in self.layouts:
                h = slot.relative[lay].cpu()
                nz = torch.nonzero(h).flatten().tolist()
                zero, nonfinite, oor = slot.extra[lay].cpu().tolist()
                spread = slot.spread[lay].cpu().tolist()
                entry["relative"][lay] = {"bins": {str(i): int(h[i]) for i in nz}, "zero": zero,
                                          "nonfinite": nonfinite, "out_of_range": oor,
                                          "spread": {str(i): n for i, n in enumerate(spread) if n}}
            if slot.current is not None:
                cur = slot.current.cpu().tolist()
                entry["current"] = {el: _counts(cur[i]) for i, el in enumerate(("e4m3", "e5m2"))}
            if slot.delayed is not None:
                dl = slot.delayed.cpu().tolist()
                entry["delayed"] = [
                    {**recipe.to_dict(), "element": el, "counts": _counts(dl[r][i])}
                    for r, recipe in enumerate(self.delayed) for i, el in enumerate(("e4m3", "e5m2"))
                ]
            if slot.nvfp4 is not None and slot.sr is not None:
                nv, sr = slot.nvfp4.cpu().tolist(), slot.sr.cpu().tolist()
                entry["nvfp4"] = {
                    variant: {**_counts(nv[i][:4]), "blocks_lost": nv[i][4], "values_in_lost_blocks": nv[i][5],
                              "expected_zero_sr": sr[i]}
                    for i, (variant, *_) in enumerate(NV_VARIANTS)
                }
            tensors.append(entry)
        order = {k: i for i, k in enumerate(BLOCK_KINDS)}
        names = [n for n, _ in self.model.named_modules()]
        pos = {n: i for i, n in enumerate(names)}
        tensors.sort(key=lambda t: (pos.get(t["module"], len(pos)), order.get(t["kind"], 9)))
        return {"version": 1, "families": sorted(self.families), "layouts": list(self.layouts),
                "steps": self.steps + (1 if self._step_has_data else 0), "hook_errors": self.errors,
                "tensors": tensors}


def _counts(row: Sequence[int]) -> dict[str, int]:
    return dict(zip(blockstats.COUNT_FIELDS, (int(v) for v in row)))


def _update_scales(scales: torch.Tensor, history: torch.Tensor, recipe: DelayedRecipe) -> None:
    """TE's delayed-scaling update, in place on the device: ``(max / amax) / 2^margin``, kept while amax is 0."""
    ref = history.amax() if recipe.algo == "max" else history[0]
    for i, el in enumerate(("e4m3", "e5m2")):
        new = torch.full_like(ref, ELEMENTS[el].max).div_(ref).div_(2.0 ** recipe.margin)  # true divisions, on device
        scales[i] = torch.where(ref > 0, new, scales[i])
