"""The Probe: hooks that feed a model's gradients to the statistics engine.

Counts stay on the device in tensors; nothing in a hook synchronises with the host.
Everything comes to the host once, in :meth:`Probe.report`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import fnmatch
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fp16probe.capture import distributed as _distributed
from fp16probe._version import __version__
from fp16probe.errors import ProbeError
from fp16probe.capture.engine import (
    NUM_BINS,
    NUM_RAW,
    SLOT_INF,
    SLOT_NAN,
    SLOT_ZERO,
    canonical_counts,
    max_abs_from_key,
    raw_histogram,
)
from fp16probe.report import (
    ACTIVATION,
    ACTIVATION_GRAD,
    KINDS,
    WEIGHT_GRAD,
    Histogram,
    Metadata,
    ModuleStats,
    Report,
    StepTrace,
)

__all__ = ["Probe", "iter_tensors"]

ROOT_NAME = "(model)"
GRANULARITIES = ("module", "op")


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield the tensors in a module output: tensors, tuples, lists, dicts, dataclasses
    and mapping-like model outputs (Hugging Face's ModelOutput is an OrderedDict)."""
    if _depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_tensors(v, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), _depth + 1)


_PENDING_LIMIT = 256  # results held before folding: 256 x 64 KiB at most per kind


def _row_index(rows: Any, device: torch.device) -> torch.Tensor:
    """Row numbers as an index tensor on ``device``.

    Built on the host and sent with ``non_blocking=True``: ``torch.tensor(..., device=cuda)``
    would wait for the copy (a host-device synchronisation) inside a hook.
    """
    index = torch.tensor(list(rows), dtype=torch.int64)
    return index if device.type == "cpu" else index.to(device, non_blocking=True)


class _KindStats:
    """Device-side counters for one kind of value (activation grads, weight grads, ...)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.types: list[str] = []
        self.index: dict[str, int] = {}
        self.device: torch.device | None = None
        self.step_counts: torch.Tensor | None = None  # [M, NUM_RAW] int64, this step
        self.step_key: torch.Tensor | None = None  # [M] int32, this step
        self.total_counts: torch.Tensor | None = None  # [M, NUM_RAW], finished steps
        self.total_key: torch.Tensor | None = None  # [M]
        self.trace_counts: list[torch.Tensor] = []  # per finished step: [NUM_BINS]
        self.trace_key: list[torch.Tensor] = []  # per finished step: [M]
        # Results not yet folded into step_counts: folding them in batches costs a few
        # ops per batch instead of four per tensor (a model has many small tensors).
        self.pending_add: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.pending_set: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dirty = False

    def register(self, name: str, type_name: str) -> int:
        i = self.index.get(name)
        if i is None:
            i = len(self.names)
            self.index[name] = i
            self.names.append(name)
            self.types.append(type_name)
            if self.device is not None:
                self._grow()
        return i

    def _alloc(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.zeros(rows, NUM_RAW, dtype=torch.int64, device=device),
            torch.full((rows,), -1, dtype=torch.int32, device=device),
        )

    def _grow(self) -> None:
        assert self.device is not None
        extra = len(self.names) - self.step_counts.shape[0]
        if extra <= 0:
            return
        c, k = self._alloc(extra, self.device)
        self.step_counts = torch.cat([self.step_counts, c])
        self.step_key = torch.cat([self.step_key, k])
        c, k = self._alloc(extra, self.device)
        self.total_counts = torch.cat([self.total_counts, c])
        self.total_key = torch.cat([self.total_key, k])
        self.trace_key = [torch.cat([t, k.new_full((extra,), -1)]) for t in self.trace_key]

    def ensure(self, device: torch.device, closed_steps: int = 0) -> None:
        if self.device is None:
            self.device = device
            rows = len(self.names)
            self.step_counts, self.step_key = self._alloc(rows, device)
            self.total_counts, self.total_key = self._alloc(rows, device)
            # A kind first seen after some steps closed (e.g. a no_grad forward before any
            # backward) still needs one trace row per closed step to stay aligned.
            for _ in range(closed_steps):
                self.pad_step()

    def add(self, i: int, raw: torch.Tensor, key: torch.Tensor, replace: bool) -> None:
        if raw.device != self.device:
            raw = raw.to(self.device, non_blocking=True)
            key = key.to(self.device, non_blocking=True)
        if replace:  # the last accumulated value of a parameter's grad wins within a step
            if self.pending_add and any(j == i for j, _, _ in self.pending_add):
                self.pending_add = [e for e in self.pending_add if e[0] != i]
            self.pending_set[i] = (raw, key)
        else:
            self.pending_add.append((i, raw, key))
            if len(self.pending_add) >= _PENDING_LIMIT:  # bounds the memory held
                self.flush()
        self.dirty = True

    def flush(self) -> None:
        """Fold pending results into the step counters: replaced rows first, then sums."""
        if self.pending_set:
            rows = _row_index(self.pending_set, self.device)
            raws, keys = zip(*self.pending_set.values())
            self.step_counts.index_copy_(0, rows, torch.stack(raws))
            self.step_key.index_copy_(0, rows, torch.stack(keys))
            self.pending_set = {}
        if self.pending_add:
            # Merge repeats of a row first (a module called twice, gradient accumulation)
            # so the rows are unique: gather + add + copy is far cheaper on the CPU than
            # index_add_ over [rows, NUM_RAW], which runs as a serial scatter.
            groups: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for i, raw, key in self.pending_add:
                groups.setdefault(i, []).append((raw, key))
            raws, keys = [], []
            for g in groups.values():
                raw, key = g[0]
                for r, k in g[1:]:
                    raw, key = raw + r, torch.maximum(key, k)
                raws.append(raw)
                keys.append(key)
            rows = _row_index(groups, self.device)
            self.step_counts.index_copy_(0, rows, self.step_counts.index_select(0, rows).add_(torch.stack(raws)))
            self.step_key.index_copy_(0, rows, torch.maximum(self.step_key.index_select(0, rows), torch.stack(keys)))
            self.pending_add = []

    def close_step(self) -> None:
        """Fold this step into the totals and the trace; clear the step counters."""
        if self.device is None:
            return
        self.flush()
        self.total_counts += self.step_counts
        torch.maximum(self.total_key, self.step_key, out=self.total_key)
        self.trace_counts.append(canonical_counts(self.step_counts.sum(0)))
        self.trace_key.append(self.step_key.clone())
        self.step_counts.zero_()
        self.step_key.fill_(-1)
        self.dirty = False

    def snapshot(self, open_step: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Totals and trace rows, with the open step included when ``open_step``, changing nothing.

        The open step stays open: more values may still arrive in it (report() called
        mid-step), and closing it here would count them twice.
        """
        if not open_step:
            return self.total_counts, self.total_key, self.trace_counts, self.trace_key
        self.flush()  # folds pending results into the step counters; idempotent
        return (
            self.total_counts + self.step_counts,
            torch.maximum(self.total_key, self.step_key),
            self.trace_counts + [canonical_counts(self.step_counts.sum(0))],
            self.trace_key + [self.step_key.clone()],
        )

    def pad_step(self) -> None:
        """Record an empty trace row, so every kind has one row per finished step."""
        if self.device is None:
            return
        self.trace_counts.append(torch.zeros(NUM_BINS, dtype=torch.int64, device=self.device))
        self.trace_key.append(torch.full((len(self.names),), -1, dtype=torch.int32, device=self.device))


class Probe:
    """Capture log2 histograms of a model's gradients during training.

    Args:
        model: the module to probe.
        modules: name patterns (``fnmatch``, e.g. ``"encoder.*.attn*"``) of the modules
            to hook. Default: every leaf module (no double counting through containers).
        types: hook only modules of these classes (combined with ``modules``).
        activation_grads: capture the gradient w.r.t. each hooked module's output.
        weight_grads: capture each parameter's accumulated gradient.
        activations: also capture forward outputs (forward-pass overflow is real too).
        every: sample every Nth step (counted by :meth:`step`); others cost nothing.
        scaler: the ``torch.amp.GradScaler`` the training loop uses. Gradients seen in
            backward are then scaled; the Probe records them unscaled, using the
            scaler's scale as a device tensor (no ``get_scale()`` sync).
        precision: what the run computes in, for the report (default: detected from
            autocast at the first probed forward; "fp32" without autocast).
        granularity: ``"module"`` records the gradient of each hooked module's output;
            ``"op"`` records the gradient of every differentiable op's output inside
            the selected modules (functional calls too: ``F.gelu``, residual adds,
            softmax), named ``"<module>/<op>"`` (see :mod:`fp16probe.capture.ops`). With
            ``"op"`` the default selection is every module, not only leaves.

    Under torch.distributed (a process group of more than one rank at :meth:`start`),
    weight gradients are read once backward has finished, after DDP's all-reduce, so
    they are the gradients the optimizer steps with (see :mod:`fp16probe.capture.distributed`).

    Use as a context manager (hooks are removed on exit, also by exception) or with
    :meth:`start`/:meth:`stop`; call :meth:`step` at each optimizer step and
    :meth:`report` to bring the statistics to the host.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        modules: Sequence[str] | str | None = None,
        types: Sequence[type] | type | None = None,
        activation_grads: bool = True,
        weight_grads: bool = True,
        activations: bool = False,
        every: int = 1,
        scaler: Any = None,
        precision: str | None = None,
        granularity: str = "module",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ProbeError(f"Probe needs a torch.nn.Module, got {type(model).__name__}")
        if int(every) < 1:
            raise ProbeError(f"every must be a positive number of steps, got {every!r}")
        if not (activation_grads or weight_grads or activations):
            raise ProbeError("nothing to capture: enable activation_grads, weight_grads or activations")
        if granularity not in GRANULARITIES:
            raise ProbeError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.granularity = granularity
        self.model = model
        self.every = int(every)
        self.scaler = scaler
        self._capture = {
            ACTIVATION_GRAD: bool(activation_grads),
            WEIGHT_GRAD: bool(weight_grads),
            ACTIVATION: bool(activations),
        }
        self._patterns = [modules] if isinstance(modules, str) else list(modules or [])
        self._types = tuple(types) if isinstance(types, (list, tuple)) else ((types,) if types else ())
        self._precision = precision
        self._stats = {k: _KindStats() for k in KINDS}
        self._handles: list[Any] = []
        self._active = False
        self._lock = threading.Lock()
        self._step_index = 0  # step() calls so far
        self._sampling = True
        self._step_dirty = False
        self._trace_steps: list[int] = []
        self._trace_scale: list[torch.Tensor | None] = []
        self._step_scale: torch.Tensor | None = None
        self._inv_scale: torch.Tensor | None = None
        self._errors = 0
        self._first_error: str | None = None
        self._device_seen: str | None = None
        self._defer_weight_grads = False
        self._deferred: list[tuple[int, torch.Tensor]] = []
        self._hooked: list[str] = self._select_modules()
        if not self._hooked and not weight_grads:
            raise ProbeError(
                f"no module of {type(model).__name__} matches modules={self._patterns!r} "
                f"types={[t.__name__ for t in self._types]!r}; check the names with model.named_modules()"
            )

    # -- selection -------------------------------------------------------------------
    def _select_modules(self) -> list[str]:
        chosen = []
        for name, module in self.model.named_modules():
            display = name or ROOT_NAME
            if self._patterns:
                if not any(fnmatch.fnmatchcase(display, p) for p in self._patterns):
                    continue
            elif (
                not self._types and self.granularity == "module" and next(module.children(), None) is not None
            ):
                continue  # default: leaves only (op granularity names ops by their innermost module)
            if self._types and not isinstance(module, self._types):
                continue
            chosen.append(name)
        return chosen

    @property
    def hooked_modules(self) -> tuple[str, ...]:
        return tuple(n or ROOT_NAME for n in self._hooked)

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "Probe":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "Probe":
        """Register the hooks. Calling it twice is an error; stop() first."""
        if self._active:
            raise ProbeError("this Probe is already started")
        modules = dict(self.model.named_modules())
        # DDP all-reduces weight gradients after their accumulate hooks fire: read them later.
        self._defer_weight_grads = _distributed.is_distributed()
        try:
            if self.granularity == "op" and (self._capture[ACTIVATION] or self._capture[ACTIVATION_GRAD]):
                from fp16probe.capture import ops

                self._handles.extend(ops.attach(self, self._hooked))
            for name in (self._hooked if self.granularity == "module" else ()):
                module = modules[name]
                display = name or ROOT_NAME
                tname = type(module).__name__
                act_i = self._stats[ACTIVATION].register(display, tname) if self._capture[ACTIVATION] else None
                grad_i = (
                    self._stats[ACTIVATION_GRAD].register(display, tname)
                    if self._capture[ACTIVATION_GRAD]
                    else None
                )
                if act_i is not None or grad_i is not None:
                    self._handles.append(module.register_forward_hook(self._forward_hook(act_i, grad_i)))
            if self._capture[WEIGHT_GRAD]:
                for pname, p in self.model.named_parameters():
                    if not p.requires_grad:
                        continue
                    owner = pname.rsplit(".", 1)[0] if "." in pname else ""
                    tname = type(modules.get(owner, self.model)).__name__
                    i = self._stats[WEIGHT_GRAD].register(pname, tname)
                    self._handles.append(p.register_post_accumulate_grad_hook(self._param_hook(i)))
        except BaseException:
            self._remove_hooks()
            raise
        self._active = True
        return self

    def stop(self) -> "Probe":
        """Remove every hook. Collected statistics stay for :meth:`report`."""
        self._active = False
        self._remove_hooks()
        return self

    def _remove_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            try:
                h.remove()
            except Exception:  # a hook handle whose owner is gone
                pass

    @property
    def active(self) -> bool:
        return self._active

    # -- hooks (hot path: no host synchronisation) ------------------------------------
    def _forward_hook(self, act_i: int | None, grad_i: int | None):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not (self._active and self._sampling):
                return
            try:
                if self._precision is None:
                    self._precision = _detect_precision(output)
                seen: set[int] = set()
                for t in iter_tensors(output):
                    # The same tensor twice in one output (HF's last_hidden_state is also
                    # hidden_states[-1]) has one gradient: count it once.
                    if not t.is_floating_point() or id(t) in seen:
                        continue
                    seen.add(id(t))
                    if act_i is not None:
                        self._record(ACTIVATION, act_i, t, replace=False, unscale=False)
                    if grad_i is not None and t.requires_grad:
                        t.register_hook(self._grad_hook(grad_i))
            except Exception as e:  # bookkeeping must never break training
                self._note_error(e)

        return hook

    def _grad_hook(self, i: int):
        def hook(grad: torch.Tensor) -> None:
            if self._active:
                self._record(ACTIVATION_GRAD, i, grad, replace=False, unscale=True)

        return hook

    def _param_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if not (self._active and self._sampling and p.grad is not None):
                return
            if self._defer_weight_grads:
                self._defer_weight_grad(i, p)
            else:
                self._record(WEIGHT_GRAD, i, p.grad, replace=True, unscale=True)

        return hook

    def _defer_weight_grad(self, i: int, p: torch.Tensor) -> None:
        try:
            with self._lock:
                self._deferred.append((i, p))
                first = len(self._deferred) == 1
            if first:
                _distributed.after_backward(self._flush_deferred)
        except Exception as e:
            self._note_error(e)

    def _flush_deferred(self) -> None:
        with self._lock:
            pending, self._deferred = self._deferred, []
        for i, p in pending:
            if p.grad is not None:
                self._record(WEIGHT_GRAD, i, p.grad, replace=True, unscale=True)

    def _record(self, kind: str, i: int, t: torch.Tensor, *, replace: bool, unscale: bool) -> None:
        try:
            if t.is_sparse or t.is_complex() or not t.is_floating_point():
                return
            if unscale:
                inv = self._current_inv_scale(t.device)
                if inv is not None:
                    t = t.detach().float() * inv
            raw, key = raw_histogram(t)
            with self._lock:
                stats = self._stats[kind]
                stats.ensure(raw.device, len(self._trace_steps))
                stats.add(i, raw, key, replace)
                self._step_dirty = True
                if self._device_seen is None:
                    self._device_seen = str(raw.device)
        except Exception as e:
            self._note_error(e)

    def _current_inv_scale(self, device: torch.device) -> torch.Tensor | None:
        scaler = self.scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        if self._inv_scale is None:
            scale = getattr(scaler, "_scale", None)
            if scale is None:  # scaler.scale() not called yet: gradients are not scaled
                return None
            self._step_scale = scale.detach().clone()
            # As GradScaler.unscale_ does: the reciprocal in double, applied in fp32.
            self._inv_scale = scale.double().reciprocal().float()
        inv = self._inv_scale
        return inv if inv.device == device else inv.to(device, non_blocking=True)

    def _note_error(self, e: BaseException) -> None:
        self._errors += 1
        if self._first_error is None:
            self._first_error = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"fp16probe: a hook failed and was skipped ({self._first_error}); training goes on",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- steps -----------------------------------------------------------------------
    def step(self) -> None:
        """Mark a step boundary (call once per optimizer step)."""
        with self._lock:
            if self._sampling and self._step_dirty:
                self._close_step()
            self._step_index += 1
            self._sampling = self._step_index % self.every == 0
            self._inv_scale = None
            self._step_scale = None

    def _close_step(self) -> None:
        for stats in self._stats.values():
            if stats.dirty:
                stats.close_step()
            else:
                stats.pad_step()
        self._trace_steps.append(self._step_index)
        self._trace_scale.append(self._step_scale)
        self._step_dirty = False

    @property
    def steps_seen(self) -> int:
        return len(self._trace_steps) + (1 if self._step_dirty else 0)

    # -- report ------------------------------------------------------------------------
    def report(self, *, partial: bool = False, extra: Mapping[str, Any] | None = None) -> Report:
        """Bring the statistics to the host (one transfer per device) and return a Report.

        A step still open (recorded but not yet closed by :meth:`step`) is included
        without closing it, so calling report() twice, or mid-step and then again after
        :meth:`step`, never counts a value twice.
        This synchronises with the device; call it outside the training hot path.
        """
        with self._lock:
            open_step = self._step_dirty
            trace_steps = self._trace_steps + ([self._step_index] if open_step else [])
            trace_scale = self._trace_scale + ([self._step_scale] if open_step else [])
            modules: list[ModuleStats] = []
            trace_hists: dict[str, tuple[Histogram, ...]] = {}
            module_max: dict[str, dict[str, tuple[float, ...]]] = {}
            n_steps = len(trace_steps)
            order = {n: i for i, n in enumerate(self.hooked_modules)}
            for kind, stats in self._stats.items():
                if not self._capture[kind] or stats.device is None:
                    continue
                total_counts, keys, trace_counts, trace_keys = stats.snapshot(open_step)
                total = canonical_counts(total_counts)
                trace = torch.stack(trace_counts) if trace_counts else None
                trace_key = torch.stack(trace_keys) if trace_keys else None
                host = [t.cpu() if t is not None else None for t in (total, keys, trace, trace_key)]
                total_h, keys_h, trace_h, trace_key_h = [
                    t.tolist() if t is not None else None for t in host
                ]
                for i, name in enumerate(stats.names):
                    modules.append(
                        ModuleStats(
                            name=name,
                            kind=kind,
                            module_type=stats.types[i],
                            order=order.get(name, len(order) + i),
                            histogram=_histogram_from(total_h[i], keys_h[i]),
                        )
                    )
                if trace_h is not None:
                    hists = []
                    for row, keys_row in zip(trace_h, trace_key_h):
                        step_key = max(keys_row) if keys_row else -1
                        hists.append(_histogram_from(row, step_key))
                    trace_hists[kind] = tuple(hists)
                    module_max[kind] = {
                        name: tuple(max_abs_from_key(r[i]) for r in trace_key_h)
                        for i, name in enumerate(stats.names)
                    }
            scales = trace_scale
            scale_vals = (
                torch.stack([s.float().reshape(()).cpu() for s in scales if s is not None]).tolist()
                if any(s is not None for s in scales)
                else []
            )
            it = iter(scale_vals)
            scale_host = tuple(None if s is None else float(next(it)) for s in scales)
            found_inf = tuple(
                any(h[i].nonfinite > 0 for k, h in trace_hists.items() if k != ACTIVATION)
                for i in range(n_steps)
            )
            trace = StepTrace(
                steps=tuple(trace_steps),
                histograms=trace_hists,
                module_max=module_max,
                scale=scale_host,
                found_inf=found_inf,
            )
            extra_meta = dict(extra or {})
            if self.granularity != "module":
                extra_meta["granularity"] = self.granularity
            if self._errors:
                extra_meta["hook_errors"] = self._errors
                extra_meta["first_hook_error"] = self._first_error
            param = next(self.model.parameters(), None)
            metadata = Metadata(
                fp16probe_version=__version__,
                torch_version=torch.__version__,
                device=self._device_seen or (str(param.device) if param is not None else "cpu"),
                model_class=type(self.model).__name__,
                precision=self._precision or "fp32",
                param_dtype=str(param.dtype) if param is not None else "none",
                steps_seen=n_steps,
                steps_total=max(self._step_index, n_steps),
                every=self.every,
                captured=tuple(k for k in KINDS if self._capture[k]),
                hooked_modules=self.hooked_modules,
                grad_scaler=self.scaler is not None,
                world_size=1,
                partial=partial,
                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                extra=extra_meta,
            )
            return Report(metadata=metadata, modules=tuple(modules), trace=trace)


def _histogram_from(row: Sequence[int], key: int) -> Histogram:
    return Histogram(
        counts=tuple(row[:SLOT_ZERO]),
        zero=row[SLOT_ZERO],
        inf=row[SLOT_INF],
        nan=row[SLOT_NAN],
        max_abs=max_abs_from_key(key),
    )


def _detect_precision(output: Any) -> str | None:
    for t in iter_tensors(output):
        if t.is_floating_point():
            dev = t.device.type
            try:
                if torch.is_autocast_enabled(dev):
                    dtype = torch.get_autocast_dtype(dev)
                    return {torch.float16: "fp16-autocast", torch.bfloat16: "bf16-autocast"}.get(
                        dtype, f"{dtype}-autocast"
                    )
            except (TypeError, RuntimeError):
                pass
            return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(t.dtype, "fp32")
    return None
