"""The recorder: device-side counts of everything captured, closed step by step.

Module hooks (:mod:`fp16probe.capture.probe`) and op capture (:mod:`fp16probe.capture.ops`)
talk to it through one small public interface, the way torch's ``FlopCounterMode`` calls
one method of its counter:

* :meth:`Recorder.capture_output` -- a module or op produced ``output``: count it as an
  activation and/or hook its gradient, as the capture settings say;
* :meth:`Recorder.param_grad_ready` -- a parameter's gradient was accumulated: count it
  in this backward (a large one now, the others together once backward is over);
* :meth:`Recorder.note_max` -- fold a device scalar into a named per-step maximum
  (the overflow ceiling);
* :meth:`Recorder.note_error` -- a hook failed for a bookkeeping reason.

Counts go straight into preallocated per-row device tables (one row per module, op or
parameter; :func:`fp16probe.capture.engine.count_into`): no per-tensor allocation, list or
index tensor, and nothing is brought to the host until :meth:`Recorder.collect`.

A step is closed atomically (:meth:`Recorder.close_step`): the new state is built out of
place and committed by one assignment, so an exception or Ctrl-C anywhere inside leaves
either the step fully open or fully closed, never a trace whose parts disagree.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from fp16probe.capture import distributed as _distributed
from fp16probe.errors import message_of
from fp16probe.capture import engine
from fp16probe.capture.ceiling import CHANNEL, mark_node_covered
from fp16probe.capture.compiled import CompileSeen
from fp16probe.capture.engine import NUM_BINS, SLOT_INF, SLOT_NAN, SLOT_ZERO, max_abs_from_key
from fp16probe.capture.scale import scale_source
from fp16probe.formats import get_format
from fp16probe.histogram import Histogram
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD, KINDS, WEIGHT_GRAD, ModuleStats, StepTrace

__all__ = ["ROOT_NAME", "Collected", "Recorder", "detect_precision", "histogram_from", "iter_tensors"]

ROOT_NAME = "(model)"
FORWARD = "forward"  # the per-step maximum of every recorded forward output (note_forward)


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


def detect_precision(output: Any) -> str | None:
    """Name what a forward output was computed in: ``"fp16-autocast"``, ``"bf16"``, ``"fp32"``..."""
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


def histogram_from(row: Sequence[int], key: int) -> Histogram:
    """Build a Histogram from one host-side row of canonical counts and its key."""
    return Histogram(
        counts=tuple(row[:SLOT_ZERO]),
        zero=row[SLOT_ZERO],
        inf=row[SLOT_INF],
        nan=row[SLOT_NAN],
        max_abs=max_abs_from_key(key),
    )


class _Rows:
    """The names and module types of one kind's rows, in registration order."""

    __slots__ = ("names", "types", "index")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.types: list[str] = []
        self.index: dict[str, int] = {}

    def add(self, name: str, type_name: str) -> int:
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.names)
            self.names.append(name)
            self.types.append(type_name)
        return i


Table = tuple[torch.Tensor, torch.Tensor]  # ([rows, NUM_BINS] int64 counts, [rows] int32 keys)


class _State:
    """Everything a step boundary changes, replaced as a whole (the unit of commit).

    ``open`` holds the counts of the step being recorded, ``spare`` an already-zeroed
    table the next step will use, ``totals`` the sums over closed steps.
    """

    __slots__ = ("step_index", "sampling", "closed", "open", "spare", "totals", "dirty", "scale", "inv", "maxima")

    def __init__(self, step_index: int, sampling: bool, closed: int, open_: dict, spare: dict, totals: dict) -> None:
        self.step_index = step_index
        self.sampling = sampling
        self.closed = closed  # trace records that count (the trace list may hold one more)
        self.open: dict[str, Table] = open_
        self.spare: dict[str, Table] = spare
        self.totals: dict[str, Table] = totals
        self.dirty = False
        self.scale: torch.Tensor | None = None
        self.inv: torch.Tensor | None = None
        self.maxima: dict[str, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True)
class _StepRecord:
    step: int
    scale: torch.Tensor | None
    kinds: Mapping[str, Table]  # per kind: ([NUM_BINS] counts summed over rows, [rows] keys)
    maxima: Mapping[str, torch.Tensor]
    # per gradient kind: [rows] bool, whether the row's values held inf or NaN (read for skipped steps only)
    nonfinite: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Collected:
    """What the recorder holds, brought to the host: module rows and the per-step trace."""

    modules: tuple[ModuleStats, ...]
    trace: StepTrace
    maxima: Mapping[str, tuple[float, ...]]
    steps_total: int
    device: str | None
    precision: str | None
    errors: int
    first_error: str | None


class Recorder:
    """Count captured tensors into per-row device tables, step by step.

    Args:
        capture: which kinds to record (``{"activation_grad": True, ...}``).
        every: sample every Nth step; the others record nothing.
        scaler: what scales the loss (a ``torch.amp.GradScaler``, a DeepSpeed or Megatron
            scaler, a number, a tensor or a callable; see :mod:`fp16probe.capture.scale`),
            whose scale divides the gradients seen, or None. Unreadable: ProbeError.
        precision: what the run computes in, or None to detect it from the first output.
    """

    def __init__(self, capture: Mapping[str, bool], *, every: int = 1, scaler: Any = None,
                 precision: str | None = None) -> None:
        self.capture = {k: bool(capture.get(k, False)) for k in KINDS}
        self._watches_grads = self.capture[ACTIVATION_GRAD] or self.capture[WEIGHT_GRAD]
        self.every = int(every)
        self.scaler = scaler
        self.scale_source = scale_source(scaler)  # ProbeError when no scale can be read from it
        self.precision = precision
        self._thin: tuple[Any, ...] | None = None  # _thin_path() of the state it was made for (every step has a new one)
        self.forward = False  # note_forward: each floating output's max |x| (the Probe's forward=)
        # Tells the overflow ceiling a histogram counts output ``output_nr`` of a node (the Probe's ceiling.cover).
        self.cover: Callable[[Any, int], None] = mark_node_covered
        self._forward = _ForwardMaxima()
        self.sharded_weight_grads = False  # a DTensor gradient (FSDP2) was read from its local shard
        self.compile_seen = CompileSeen()  # a hook of this Probe was traced by dynamo (torch.compile)
        self.enabled = False
        self.defer_to_ddp = False  # weight grads after DDP's all-reduce (see distributed.after_backward)
        self.lock = threading.Lock()
        self.rows = {k: _Rows() for k in KINDS}
        self._output_rows: dict[str, tuple[int | None, int | None, Any]] = {}  # activation, gradient row, hook
        self._grad_hooks: dict[int, Callable[[torch.Tensor], None]] = {}  # one closure per row, reused
        self._node_hooks: dict[tuple[int, int], Callable[[tuple[Any, ...]], None]] = {}  # per (row, output_nr)
        self._state = _State(0, True, 0, {}, {}, {})
        self._trace: list[_StepRecord] = []
        self._next_totals: dict[str, Table] = {}  # CPU: the buffers the next close writes its totals into
        self._pending_params: list[tuple[int, torch.Tensor]] = []
        self._weights_open = False  # a backward's weight counting has begun (its end-of-backward count is queued)
        # What this backward's weight counts read, for the history (take_weight_largest): the parameters
        # counted, their largest |bits| (None: some went another way), and whether the count is done.
        self._weights_counted = 0
        self._weight_bits: int | None = -1
        self._weights_done = False
        self._params_counted_in: _State | None = None  # the step state weight rows were last counted in
        self._device: str | None = None
        self.errors = 0
        self.first_error: str | None = None

    # -- registration ------------------------------------------------------------------
    def register(self, kind: str, name: str, type_name: str) -> int:
        """Give ``name`` a row of ``kind`` (the same row when asked again); return its index."""
        with self.lock:
            rows = self.rows[kind]
            before = len(rows.names)
            i = rows.add(name, type_name)
            if len(rows.names) != before and kind in self._state.open:
                self._grow(kind)
            return i

    @property
    def sampling(self) -> bool:
        """Whether the open step is sampled (``every``)."""
        return self._state.sampling

    @property
    def step_index(self) -> int:
        """Step boundaries passed so far."""
        return self._state.step_index

    @property
    def steps_seen(self) -> int:
        """Steps closed with data, plus the open one if anything was recorded in it."""
        st = self._state
        return st.closed + (1 if st.dirty else 0)

    @property
    def step_open(self) -> bool:
        """Whether anything was recorded since the last closed step."""
        return bool(self._state.dirty)

    # -- the interface hooks use (hot path: no host synchronisation) -------------------
    def capture_output(self, name: str, type_name: str, output: Any) -> None:
        """Record what a module or op named ``name`` produced: activations and/or a gradient hook."""
        if not (self.enabled and self._state.sampling):
            return
        try:
            # A Probe that watches gradients watches training: a forward under no_grad (an RL rollout's
            # generation, its old log-probabilities, an evaluation) is not the training forward, often runs
            # without autocast, and says nothing of the run's precision or its fp16 forward headroom.
            training = torch.is_grad_enabled() or not self._watches_grads
            if self.precision is None and training:
                self.precision = detect_precision(output)
            rows = self._output_rows.get(name)
            if rows is None:
                grad_row = self.register(ACTIVATION_GRAD, name, type_name) if self.capture[ACTIVATION_GRAD] else None
                rows = self._output_rows[name] = (
                    self.register(ACTIVATION, name, type_name) if self.capture[ACTIVATION] else None,
                    grad_row, None if grad_row is None else self._node_hook(grad_row, 0),
                )
            act_i, grad_i, first_output_hook = rows
            if type(output) is torch.Tensor:  # the common case, without the generator
                if output.is_floating_point():
                    if self.forward and training:
                        self.note_forward(name, output)
                    if act_i is not None:
                        self.record(ACTIVATION, act_i, output)
                    if grad_i is not None and output.requires_grad:
                        node = output.grad_fn
                        if node is not None:  # a pre-hook on the node: half the cost of Tensor.register_hook
                            nr = output.output_nr
                            node.register_prehook(first_output_hook if nr == 0 else self._node_hook(grad_i, nr))
                            self.cover(node, nr)
                        else:  # a leaf: no node for the ceiling to leave out
                            output.register_hook(self._grad_hook(grad_i))
                return
            seen: set[int] = set()
            for t in iter_tensors(output):
                # The same tensor twice in one output (HF's last_hidden_state is also
                # hidden_states[-1]) has one gradient: count it once.
                if not t.is_floating_point() or id(t) in seen:
                    continue
                seen.add(id(t))
                if self.forward and training:
                    self.note_forward(name, t)
                if act_i is not None:
                    self.record(ACTIVATION, act_i, t)
                if grad_i is not None and t.requires_grad:
                    t.register_hook(self._grad_hook(grad_i))
                    if t.grad_fn is not None:
                        self.cover(t.grad_fn, t.output_nr)
        except Exception as e:  # bookkeeping must never break training
            self.note_error(e)

    def _grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        hook = self._grad_hooks.get(i)
        if hook is None:

            def hook(grad: torch.Tensor) -> None:
                if self.enabled:
                    self._record_grad(i, grad)

            self._grad_hooks[i] = hook
        return hook

    def _node_hook(self, i: int, output_nr: int) -> Callable[[tuple[Any, ...]], None]:
        """A pre-hook for the node that made an output of row ``i``: it counts that output's gradient."""
        hook = self._node_hooks.get((i, output_nr))
        if hook is None:

            def hook(grad_outputs: tuple[Any, ...]) -> None:
                grad = grad_outputs[output_nr]
                if grad is not None and self.enabled:
                    self._record_grad(i, grad)

            self._node_hooks[(i, output_nr)] = hook
        return hook

    def _record_grad(self, i: int, grad: torch.Tensor) -> None:
        """Count an output's gradient into row ``i``: one kernel call into the row when it is plain CPU fp32."""
        if type(grad) is torch.Tensor and grad.dtype is torch.float32 and grad.is_cpu and grad.is_contiguous():
            try:
                if self._count_thin(ACTIVATION_GRAD, i, grad, replace=False) is not None:
                    return
            except Exception as e:
                self.note_error(e)
                return
        self.record(ACTIVATION_GRAD, i, grad)

    def _count_thin(self, kind: str, i: int, t: torch.Tensor, *, replace: bool) -> int | None:
        """Count the contiguous fp32 CPU tensor ``t`` into row ``i`` of ``kind`` (one of ``_THIN_KINDS``) by one
        kernel call and return its largest ``|bits|`` (inf and NaN included); None, having counted nothing,
        where the thin path does not apply (no kernel, a scaler, no CPU table yet, an empty or a large tensor,
        rows added since: the caller takes the general path)."""
        thin = self._thin
        if thin is None or thin[0] is not self._state:
            thin = self._thin = self._thin_path()
        at = 3 + 2 * _THIN_KINDS.index(kind)
        n = t.numel()
        if thin[at] is None or not 0 < n < thin[2]:
            return None
        with self.lock:
            if thin[0] is not self._state:  # no longer the step's tables: rows were added since
                return None
            bits = thin[1](t.data_ptr(), n, thin[at], thin[at + 1], i, replace)
            thin[0].dirty = True
        return bits

    def _thin_path(self) -> tuple[Any, ...]:
        """What the thin path needs for the open step: (state, kernel entry, size limit, then for each of
        ``_THIN_KINDS`` the addresses of its table's counts and keys, None without a CPU table of that kind
        yet); the entry is None where it does not apply (no numba, a scaler to unscale by). The size limit
        follows torch's thread count."""
        st = self._state
        kernel = engine.thin_counter() if self.scaler is None else None
        if kernel is None:
            return (st, None, 0, *[None] * (2 * len(_THIN_KINDS)))
        addresses: list[int | None] = []
        for kind in _THIN_KINDS:
            table = st.open.get(kind)
            on_cpu = table is not None and table[0].is_cpu
            addresses += [table[0].data_ptr(), table[1].data_ptr()] if on_cpu else [None, None]  # type: ignore[index]
        return (st, *kernel, *addresses)

    def param_grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Note that parameter row ``i`` has its gradient, now accumulated; count it in this backward.

        A plain fp32 CPU gradient of ``_HOT_FROM`` values or more is counted here, while backward
        has just written it (at the end of backward it has left the caches: 1.4 against about 0.7 ns
        a value on a GPT-style model); the rest are counted together at the end of backward, in one
        compiled call (a Python call per small parameter would cost more than its count). Both see
        the values the optimizer steps with: nothing but DDP's all-reduce changes ``.grad`` between
        its accumulation and the end of backward, and under DDP every gradient waits for that. Not
        at :meth:`close_step`: clipping, ``GradScaler.unscale_`` and ``zero_grad`` change ``.grad``
        in place after backward. A later backward in the step (gradient accumulation) replaces
        the rows: the last accumulated value wins.
        """
        if not (self.enabled and self._state.sampling):
            return
        try:
            if not self._weights_open:  # the first parameter of this backward
                self._weights_open = True
                self._weights_counted, self._weight_bits, self._weights_done = 0, -1, False
                self._keep_replaced_maximum()
                _distributed.after_backward(self._count_params, ddp=self.defer_to_ddp)
            g = param.grad
            if not (type(g) is torch.Tensor and g.numel() >= _HOT_FROM and g.dtype is torch.float32 and g.is_cpu
                    and not self.defer_to_ddp and g.is_contiguous() and self._count_hot(i, g)):
                self._pending_params.append((i, param))
        except Exception as e:
            self.note_error(e)

    def _keep_replaced_maximum(self) -> None:
        """Before a second backward in the step (gradient accumulation) replaces the weight rows, keep the
        maximum of what the last one counted for the overflow ceiling (which leaves parameters'
        AccumulateGrad nodes to these counts)."""
        table = self._state.open.get(WEIGHT_GRAD)
        if table is not None and self._params_counted_in is self._state:
            self.note_max(CHANNEL, engine.max_abs_of_keys(table[1]))

    def _count_hot(self, i: int, g: torch.Tensor) -> bool:
        """Count the contiguous fp32 CPU gradient ``g`` into weight row ``i`` (replacing it) by the thin path;
        False, having counted nothing, where it does not apply (the caller defers it)."""
        bits = self._count_thin(WEIGHT_GRAD, i, g, replace=True)
        if bits is None:
            return False
        self._weights_counted += 1
        if self._weight_bits is not None:
            self._weight_bits = max(self._weight_bits, bits)
        return True

    def take_weight_largest(self, grads: Sequence[torch.Tensor | None]) -> float | None:
        """The largest |g| (inf or NaN when one was) over the weight gradients this backward counted, once,
        when it counted as many through the compiled kernel as ``grads`` (every parameter's ``.grad``) has
        gradients; None otherwise. Called at the end of backward by the per-step history, which then
        need not read every gradient again; the weight count still queued is done first."""
        if self._weights_open:
            self._count_params()
        bits, done = self._weight_bits, self._weights_done
        self._weights_done = False
        if not done or bits is None or bits < 0 or self._weights_counted != sum(g is not None for g in grads):
            return None
        return engine.float_of_bits(bits)

    def _count_params(self) -> None:
        if not self._weights_open:  # counted already (the history asked first: take_weight_largest)
            return
        pending, self._pending_params = self._pending_params, []
        self._weights_open = False
        plain: list[tuple[int, torch.Tensor]] = []
        for i, p in pending:
            g = p.grad
            if g is None:
                continue
            if type(g) is torch.Tensor and g.is_floating_point() and not g.is_sparse and (
                not plain or g.device == plain[0][1].device
            ):
                plain.append((i, g))
            else:  # a DTensor, a sparse or non-float gradient, another device: one by one
                self.record(WEIGHT_GRAD, i, g, replace=True)
                self._weight_bits = None
            self._weights_counted += 1
        if plain:
            bits = self._record_many(WEIGHT_GRAD, plain, replace=True)
            self._weight_bits = None if bits is None or self._weight_bits is None else max(self._weight_bits, bits)
        self._params_counted_in = self._state  # recording may have committed a new state (first rows)
        self._weights_done = True

    def _record_many(self, kind: str, items: Sequence[tuple[int, torch.Tensor]], *, replace: bool) -> int | None:
        """:meth:`record` for plain tensors on one device, counted by one engine call; never raises. Returns
        what :func:`~fp16probe.capture.engine.count_many` does (None also when it failed)."""
        try:
            with self.lock:
                st, table, inv = self._open_table(kind, items[0][1].device)
                bits = engine.count_many([t for _, t in items], table[0], table[1], [i for i, _ in items],
                                         replace=replace, inv=inv)
                st.dirty = True
                return bits
        except Exception as e:
            self.note_error(e)
            return None

    def _open_table(self, kind: str, device: torch.device) -> tuple[_State, Table, torch.Tensor | None]:
        """The open step's state, its table of ``kind`` (allocated on first use) and the
        reciprocal scale that unscales ``kind`` on ``device`` (None: not scaled). Caller holds the lock."""
        st = self._state
        inv = self._inv_scale(st, device) if self.scaler is not None and kind != ACTIVATION else None
        table = st.open.get(kind)
        if table is None:
            st = self._allocate(kind, device)
            table = st.open[kind]
        return st, table, inv

    def record(self, kind: str, i: int, t: torch.Tensor, *, replace: bool = False) -> None:
        """Count ``t`` into row ``i`` of ``kind`` (gradients unscaled); never raises.

        ``replace``: overwrite the row for this step (a parameter's gradient: the last
        accumulated value wins) instead of adding to it.
        """
        try:
            if not t.is_floating_point() or t.is_sparse:
                return
            if type(t) is not torch.Tensor and hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's shard; ranks add up as shards
                t = t.to_local()
                if kind == WEIGHT_GRAD:
                    self.sharded_weight_grads = True
            with self.lock:
                st, table, inv = self._open_table(kind, t.device)
                engine.count_into(t, table[0], table[1], i, replace=replace, inv=inv)
                st.dirty = True
        except Exception as e:
            self.note_error(e)

    def note_max(self, channel: str, value: torch.Tensor) -> None:
        """Fold a device scalar into this step's maximum of ``channel`` (no host sync)."""
        try:
            with self.lock:
                st = self._state
                if not st.sampling:
                    return
                v = value
                if v.dtype is not torch.float32 or v.dim() or v.requires_grad:  # the hooks' scalars need none of it
                    v = v.detach().float().reshape(())
                old = st.maxima.get(channel)
                if old is not None and old.device != v.device:
                    v = v.to(old.device, non_blocking=True)
                st.maxima[channel] = v if old is None else torch.maximum(old, v)
                st.dirty = True
        except Exception as e:
            self.note_error(e)

    def note_forward(self, name: str, t: torch.Tensor) -> None:
        """Fold ``max |t|`` of a forward output into its module's maximum for this step (no host sync).

        Only values that are fp16 in this run count: fp16/bf16 outputs, or any floating output
        of a run without autocast (whose outputs an fp16 run would compute in fp16). inf/NaN
        propagate (a NaN maximum reads as overflow). A contiguous fp32 CPU output is one compiled
        read into the module's slot; any other takes two kernels, the ``amax`` and an in-place
        maximum into the slot.
        """
        try:
            dtype = t.dtype
            if dtype is torch.float64:
                return
            if dtype is torch.float32 and _autocast_on("cpu" if t.is_cpu else t.device.type):
                return  # autocast keeps it fp32: it cannot overflow fp16
            self._forward.fold(name, t)
            self._state.dirty = True
        except Exception as e:
            self.note_error(e)

    def close_forward(self) -> None:
        """Fold this step's forward maxima into the run's and the step's trace (a few kernels a step)."""
        try:
            if self._state.sampling:
                step_max = self._forward.close(self._state.step_index)
                if step_max is not None:
                    self.note_max(FORWARD, step_max)
        except Exception as e:
            self.note_error(e)

    def forward_maxima(self) -> tuple[dict[str, float], dict[str, int]]:
        """Each module's largest forward output over the run, and the first step it passed fp16's max
        (modules that never did are absent); brought to the host in one transfer. Includes the open step."""
        return self._forward.collect(self._state.step_index)

    def note_error(self, e: BaseException) -> None:
        """Count a failed hook; warn once, with the first failure's message."""
        self.errors += 1
        if self.first_error is None:
            self.first_error = f"{type(e).__name__}: {message_of(e)}"
            warnings.warn(
                f"fp16probe: a hook failed and was skipped ({self.first_error}); training goes on",
                RuntimeWarning,
                stacklevel=2,
            )

    def inv_scale(self, device: torch.device) -> torch.Tensor | None:
        """1 / the scale in force this step, on ``device`` (None when gradients are not scaled); no sync."""
        with self.lock:
            return self._inv_scale(self._state, device)

    def _inv_scale(self, st: _State, device: torch.device | None) -> torch.Tensor | None:
        source = self.scale_source
        if source is None:
            return None
        if st.inv is None:
            scale = source.tensor()
            if scale is None:  # e.g. GradScaler.scale() not called yet: gradients are not scaled
                return None
            if device is not None and scale.device != device and scale.device.type == "cpu":
                scale = scale.to(device, non_blocking=True)  # a host number read from the scaler
            st.scale = scale.clone()
            # As GradScaler.unscale_ does: the reciprocal in double, applied in fp32.
            st.inv = scale.double().reciprocal().float()
        inv = st.inv
        return inv if device is None or inv.device == device else inv.to(device, non_blocking=True)

    # -- storage -------------------------------------------------------------------------
    def _allocate(self, kind: str, device: torch.device) -> _State:
        """Give ``kind`` its tables on ``device`` (first value of that kind); commit by one assignment."""
        st = self._state
        n = len(self.rows[kind].names)
        new = _copy_state(st)
        new.open = {**st.open, kind: engine.new_table(n, device)}
        new.spare = {**st.spare, kind: engine.new_table(n, device)}
        new.totals = {**st.totals, kind: engine.new_table(n, device)}
        if self._device is None:
            self._device = str(device)
        self._state = new
        return new

    def _grow(self, kind: str) -> None:
        """Add rows registered after ``kind``'s tables were made (op capture finds ops as they run)."""
        st = self._state
        n = len(self.rows[kind].names)
        new = _copy_state(st)
        new.open = {**st.open, kind: _grown(st.open[kind], n)}
        new.spare = {**st.spare, kind: _grown(st.spare[kind], n)}
        new.totals = {**st.totals, kind: _grown(st.totals[kind], n)}
        self._state = new

    # -- steps ---------------------------------------------------------------------------
    def close_step(self) -> None:
        """Close the open step (if it recorded anything) and open the next one, atomically.

        Everything is computed out of place first; the last statement commits. An
        exception or KeyboardInterrupt before it leaves the step open and intact.
        """
        with self.lock:
            st = self._state
            index = st.step_index + 1
            sampling = index % self.every == 0
            if not (st.sampling and st.dirty):
                new = _State(index, sampling, st.closed, st.open, st.spare, st.totals)
                new.dirty = st.dirty  # values that arrived in an unsampled step wait for a sampled one
                self._state = new  # commit
                self._pending_params = []  # a backward that never ended (it raised): its weights go with it
                self._weights_open = False
                return
            totals: dict[str, Table] = {}
            kinds: dict[str, Table] = {}
            for kind, table in st.open.items():  # spares and next totals are read by no one: safe to redo
                if engine.compiled_close(table):  # one compiled pass
                    totals[kind] = self._totals_buffer(kind, st)
                    kinds[kind] = engine.close_table(table, st.totals[kind], totals[kind], st.spare[kind])
                    continue
                st.spare[kind][0].zero_()
                st.spare[kind][1].fill_(-1)
                totals[kind] = (st.totals[kind][0] + table[0], torch.maximum(st.totals[kind][1], table[1]))
                kinds[kind] = _step_of(table)
            record = _StepRecord(st.step_index, st.scale, kinds, dict(st.maxima), _nonfinite_rows(st.open))
            new = _State(index, sampling, st.closed + 1, st.spare, st.open, totals)
            del self._trace[st.closed :]  # a record left by an interrupted close
            self._trace.append(record)
            self._state = new  # commit
            self._next_totals = {k: t for k, t in st.totals.items() if t[0].is_cpu}  # the old totals, now unread
        self._pending_params = []
        self._weights_open = False

    def _totals_buffer(self, kind: str, st: _State) -> Table:
        """Where the close of ``st`` writes ``kind``'s new totals: the totals it replaced last time (CPU), or
        a new table of the right size; never the totals in force."""
        out = self._next_totals.get(kind)
        now = st.totals[kind]
        if out is None or out[0] is now[0] or out[0].shape != now[0].shape or out[0].device != now[0].device:
            out = engine.new_table(now[0].shape[0], now[0].device)
        return out

    def discard_step(self) -> None:
        """Drop what the open step recorded (a step cut short), keeping every closed step."""
        with self.lock:
            st = self._state
            for counts, keys in st.open.values():
                counts.zero_()
                keys.fill_(-1)
            if self._forward.step is not None:  # this step's forward maxima go with it
                self._forward.step.zero_()
            new = _State(st.step_index, st.sampling, st.closed, st.open, st.spare, st.totals)
            del self._trace[st.closed :]
            self._state = new  # commit: not dirty, no scale or maxima of the dropped step
        self._pending_params = []
        self._weights_open = False

    def _record_of(self, st: _State) -> _StepRecord:
        """The trace record of ``st``'s open step, built out of place."""
        return _StepRecord(st.step_index, st.scale, {k: _step_of(t) for k, t in st.open.items()}, dict(st.maxima),
                           _nonfinite_rows(st.open))

    def nonfinite_rows(self, steps: Sequence[int]) -> dict[int, dict[str, tuple[str, ...]]]:
        """For each of ``steps`` the recorder sampled: per gradient kind, the rows whose values held inf or
        NaN, in backward order (the rows' model order reversed: the one nearest the loss first).

        One transfer for all of them; call it when a report is asked for (a host sync), not in a hook.
        """
        wanted = set(steps)
        with self.lock:
            st = self._state
            records = [r for r in self._trace[: st.closed] if r.step in wanted]
            if st.sampling and st.dirty and st.step_index in wanted:
                records.append(self._record_of(st))
            flags = [(r.step, kind, t) for r in records for kind, t in r.nonfinite.items()]
            host = torch.cat([t.reshape(-1).cpu() for _, _, t in flags]).tolist() if flags else []
            out: dict[int, dict[str, tuple[str, ...]]] = {}
            at = 0
            for step, kind, t in flags:
                row_flags, at = host[at:at + t.numel()], at + t.numel()
                names = self.rows[kind].names
                hit = tuple(names[i] for i in reversed(range(min(len(row_flags), len(names)))) if row_flags[i])
                out.setdefault(step, {})[kind] = hit
            return out

    def memory(self) -> dict[str, int]:
        """Bytes of device memory held: the fixed tables and the per-step trace."""

        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        st = self._state
        fixed = sum(size(c) + size(k) for tables in (st.open, st.spare, st.totals) for c, k in tables.values())
        trace = sum(
            size(c) + size(k) for r in self._trace for c, k in r.kinds.values()
        ) + sum(size(r.scale) + sum(size(m) for m in r.maxima.values()) for r in self._trace)
        return {"fixed_bytes": fixed, "trace_bytes": trace, "total_bytes": fixed + trace}

    # -- collecting ----------------------------------------------------------------------
    def collect(self, order: Mapping[str, int] | None = None, since_step: int | None = None) -> Collected:
        """Bring the counts to the host (one transfer per table) and return them as data.

        A step still open is included without closing it, so collecting twice, or
        mid-step and again after :meth:`close_step`, never counts a value twice.
        ``since_step``: the per-step trace holds only steps from that one on (the module
        totals stay whole), so a live logger's cost per interval does not grow with the run.
        This synchronises with the device; call it outside the training hot path.
        """
        order = order or {}
        with self.lock:
            st = self._state
            records, open_step = self._records_since(since_step)
            modules: list[ModuleStats] = []
            histograms: dict[str, tuple[Histogram, ...]] = {}
            module_max: dict[str, dict[str, tuple[float, ...]]] = {}
            for kind in KINDS:
                if not self.capture[kind] or kind not in st.totals:
                    continue
                counts, keys = self._totals(kind, open_step)
                modules.extend(self._module_rows(kind, counts, keys, order))
                if records:
                    histograms[kind], module_max[kind] = self._kind_trace(kind, records, counts.device)
            found_inf = tuple(
                any(h[i].nonfinite > 0 for k, h in histograms.items() if k != ACTIVATION) for i in range(len(records))
            )
            channels = sorted({c for r in records for c in r.maxima})
            maxima = {
                c: tuple(float(r.maxima[c].cpu()) if c in r.maxima else 0.0 for r in records) for c in channels
            }
            trace = StepTrace(
                steps=tuple(r.step for r in records),
                histograms=histograms,
                module_max=module_max,
                scale=_scales_on_host(records),
                found_inf=found_inf,
            )
            return Collected(
                modules=tuple(modules),
                trace=trace,
                maxima=maxima,
                steps_total=max(st.step_index, len(records)),
                device=self._device,
                precision=self.precision,
                errors=self.errors,
                first_error=self.first_error,
            )

    def _records_since(self, since_step: int | None) -> tuple[list[_StepRecord], bool]:
        """The closed steps' records from ``since_step`` on (all: None), the open step's last; whether it is there."""
        st = self._state
        first = st.closed
        if since_step is None:
            first = 0
        else:  # walk back from the end: as long as the window, not the run
            while first > 0 and self._trace[first - 1].step >= since_step:
                first -= 1
        records = self._trace[first : st.closed]
        open_step = st.sampling and st.dirty
        if open_step:
            records = records + [self._record_of(st)]
        return records, open_step

    def _totals(self, kind: str, open_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's counts and max keys of ``kind`` per row, the open step's added (not closed)."""
        st = self._state
        counts, keys = st.totals[kind]
        if open_step:
            counts, keys = counts + st.open[kind][0], torch.maximum(keys, st.open[kind][1])
        return counts, keys

    def _module_rows(self, kind: str, counts: torch.Tensor, keys: torch.Tensor,
                     order: Mapping[str, int]) -> list[ModuleStats]:
        """One :class:`ModuleStats` per row of ``kind`` (one transfer for its table)."""
        rows = self.rows[kind]
        counts_h, keys_h = counts.cpu().tolist(), keys.cpu().tolist()
        return [
            ModuleStats(
                name=name,
                kind=kind,
                module_type=rows.types[i],
                order=order.get(name, len(order) + i),
                histogram=histogram_from(counts_h[i], keys_h[i]),
            )
            for i, name in enumerate(rows.names)
        ]

    def _kind_trace(self, kind: str, records: list[_StepRecord], device: torch.device
                    ) -> tuple[tuple[Histogram, ...], dict[str, tuple[float, ...]]]:
        """The per-step histograms of ``kind`` over ``records``, and each row's per-step max."""
        names = self.rows[kind].names
        trace_counts, trace_keys = _stack_trace(records, kind, len(names), device)
        step_hists = tuple(histogram_from(row, max(krow) if krow else -1)
                           for row, krow in zip(trace_counts, trace_keys))
        module_max = {name: tuple(max_abs_from_key(r[i]) for r in trace_keys) for i, name in enumerate(names)}
        return step_hists, module_max


_HOT_FROM = 1 << 12  # parameter gradients this long are counted in their accumulate hook (param_grad_ready)
_THIN_KINDS = (ACTIVATION_GRAD, WEIGHT_GRAD)  # the kinds the thin path counts into (Recorder._thin_path)
_FP16_OVERFLOW = get_format("fp16").overflow_threshold  # 65520: the first magnitude that rounds to inf
_AMINMAX_FROM = 1 << 16  # elements from which one aminmax pass beats |t| then amax


class _ForwardMaxima:
    """Per-module forward maxima on the device: this step's, the run's, and the first step past fp16's max."""

    __slots__ = ("index", "step", "views", "slots", "fold_at", "run", "first")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.step: torch.Tensor | None = None  # [capacity] float32: this step's maxima
        self.views: list[torch.Tensor] = []  # one 0-d view of ``step`` per module
        self.slots: tuple[int, int] | None = None  # ``step``'s address and length, for the CPU kernel (None: torch ops)
        self.fold_at: object | None = None  # engine.thin_largest(): fp32 CPU outputs in one compiled read
        self.run: torch.Tensor | None = None  # [capacity] float32: the run's maxima over closed steps
        self.first: torch.Tensor | None = None  # [capacity] int64: first step past 65504 (-1: none yet)

    def fold(self, name: str, t: torch.Tensor) -> None:
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.index)
        slots = self.slots  # a CPU buffer: fp32 CPU outputs fold in one compiled read
        if slots is not None and i < slots[1] and t.is_cpu and t.dtype is torch.float32 and t.is_contiguous():
            self.fold_at(t.data_ptr(), t.numel(), slots[0], i)  # type: ignore[operator]
            return
        if t.numel() == 0:
            return
        if self.step is None or i >= len(self.views) or self.step.device != t.device:
            self._grow(t.device, i + 1)
        view = self.views[i]
        d = t.detach()  # no graph is recorded from a detached tensor: no no_grad() needed (a third of the cost)
        if d.numel() >= _AMINMAX_FROM:  # one pass, no |t| copy: 2x faster on large outputs
            lo, hi = torch.aminmax(d)
            torch.maximum(view, torch.maximum(hi, lo.neg()), out=view)
        else:  # fewer kernels for small ones
            torch.maximum(view, d.abs().amax(), out=view)

    def _grow(self, device: torch.device, need: int) -> None:
        n = max(16, 2 * need)
        step = torch.zeros(n, dtype=torch.float32, device=device)
        run = torch.zeros(n, dtype=torch.float32, device=device)
        first = torch.full((n,), -1, dtype=torch.int64, device=device)
        if self.step is not None and self.run is not None and self.first is not None:
            k = self.step.numel()
            step[:k] = self.step.to(device)
            run[:k] = self.run.to(device)
            first[:k] = self.first.to(device)
        self.step, self.run, self.first = step, run, first
        self.views = [step[i] for i in range(n)]
        self.fold_at = engine.thin_largest() if step.is_cpu else None
        self.slots = None if self.fold_at is None else (step.data_ptr(), n)

    def close(self, step_index: int) -> torch.Tensor | None:
        buf = self.step
        if buf is None or self.run is None or self.first is None:
            return None
        if self.fold_at is not None:  # CPU buffers: one compiled pass instead of ten small torch ops
            bits = engine.close_forward_maxima(buf, self.run, self.first, _FP16_OVERFLOW, step_index)
            return torch.tensor(bits, dtype=torch.int32).view(torch.float32)
        with torch.no_grad():
            step_max = buf.amax()
            over = (buf >= _FP16_OVERFLOW) | torch.isnan(buf)
            self.first = torch.where(over & (self.first < 0), torch.full_like(self.first, step_index), self.first)
            self.run = torch.maximum(self.run, buf)
            buf.zero_()
        return step_max

    def collect(self, step_index: int) -> tuple[dict[str, float], dict[str, int]]:
        if self.step is None or self.run is None or self.first is None or not self.index:
            return {}, {}
        n = len(self.index)
        with torch.no_grad():  # the open step counts too, without closing it
            run = torch.maximum(self.run, self.step)[:n]
            over = ((self.step >= _FP16_OVERFLOW) | torch.isnan(self.step))[:n]
            first = torch.where(over & (self.first[:n] < 0), torch.full_like(self.first[:n], step_index),
                                self.first[:n])
            both = torch.stack([run.double(), first.double()]).cpu().tolist()
        names = sorted(self.index, key=self.index.__getitem__)
        maxima = dict(zip(names, both[0]))
        firsts = {name: int(f) for name, f in zip(names, both[1]) if f >= 0}
        return maxima, firsts


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know
        return False


def _nonfinite_rows(tables: Mapping[str, Table]) -> dict[str, torch.Tensor]:
    """Per gradient kind, which rows of the open step held inf or NaN: one small device op a kind, no sync."""
    return {k: t[0][:, SLOT_INF:SLOT_NAN + 1].any(1) for k, t in tables.items() if k in _THIN_KINDS}


def _step_of(table: Table) -> Table:
    """A step's record of one kind, out of place: its counts summed over rows and a copy of its keys (what
    ``engine.close_table`` returns on the CPU)."""
    return table[0].sum(0), table[1].clone()


def _copy_state(st: _State) -> _State:
    new = _State(st.step_index, st.sampling, st.closed, st.open, st.spare, st.totals)
    new.dirty, new.scale, new.inv, new.maxima = st.dirty, st.scale, st.inv, st.maxima
    return new


def _grown(table: Table, rows: int) -> Table:
    counts, keys = table
    extra = rows - counts.shape[0]
    c, k = engine.new_table(extra, counts.device)
    return torch.cat([counts, c]), torch.cat([keys, k])


def _scales_on_host(records: Sequence[_StepRecord]) -> tuple[float | None, ...]:
    """Each record's loss scale on the host (one transfer for all); None where a step had none."""
    scales = [r.scale for r in records]
    present = [s.float().reshape(()).cpu() for s in scales if s is not None]
    it = iter(torch.stack(present).tolist() if present else [])
    return tuple(None if s is None else float(next(it)) for s in scales)


def _stack_trace(records: Sequence[_StepRecord], kind: str, rows: int,
                 device: torch.device) -> tuple[list[list[int]], list[list[int]]]:
    """Per-step summed counts and per-row keys of ``kind`` on the host; steps without it are empty."""
    empty_counts = torch.zeros(NUM_BINS, dtype=torch.int64, device=device)
    counts, keys = [], []
    for r in records:
        c, k = r.kinds.get(kind, (empty_counts, None))
        counts.append(c)
        k = torch.full((rows,), -1, dtype=torch.int32, device=device) if k is None else k
        if k.shape[0] < rows:  # rows registered after this step closed
            k = torch.cat([k, k.new_full((rows - k.shape[0],), -1)])
        keys.append(k)
    return torch.stack(counts).cpu().tolist(), torch.stack(keys).cpu().tolist()
