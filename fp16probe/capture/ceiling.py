"""The overflow ceiling: the largest gradient magnitude backward produces anywhere, per step.

Module hooks see only the outputs of the modules that run. The loss scale multiplies every
gradient in backward: the gradient of the loss with respect to the model's output, the
gradients of functional code between and after modules (``out * gain``,
``logits / temperature``), module internals that bypass a submodule's forward
(``nn.MultiheadAttention`` uses ``out_proj.weight`` directly) and the weight gradients.
Every one of them is the input of some autograd node. So after each probed forward the
graph behind the model's outputs (and, through :meth:`CeilingHooks.watch`, behind the loss) is
walked once, and every node whose maximum nothing else counts gets a pre-hook that keeps
only ``max |g|`` of the gradients flowing into it: one reduction per node, on the gradient's
device, folded into one running maximum per step (the Recorder's ``note_max``). Nothing here
brings a value to the host.

Nodes whose gradient stays fp32 under autocast (marked by the dtype tracking of
:mod:`fp16probe.capture.ops`) are walked through but not counted. Nodes whose maximum is
counted anyway need no read of their own: one whose every output gradient a histogram
counts (a hooked module's output, a parameter's ``AccumulateGrad`` node before its first
backward of the step), one whose only consumer is a layout node (``view``, ``t``) that is
seen, and a layout node over a covered node (hooked, reading only if a later walk finds
another consumer below it). The dtype tracking costs tens of microseconds per op, so its marks are
kept and reused while the graph repeats (see :meth:`CeilingHooks.begin_forward`); on a reused
forward the gradient at an explicit cast (``h.float()`` in an RMSNorm) is seen only summed
into its producer's, as it is in an fp32 graph. The walk itself (metadata read and written on
every node) is replayed the same way: a step whose graph has the same nodes and edges in walk
order, the same marks and the same parameter gradients left in place as the last fully walked
one hooks the same nodes by position, without reading any metadata (:meth:`CeilingHooks._replay`). Scalar gradients are left out: they are the loss side's own arithmetic (the seed
``d loss / d loss = 1``, ``loss * weight``), fp32 under autocast. What it does not see: gradients inside a ``torch.compile``'d region or a custom autograd
Function's backward (one node each: only what flows in and out), and the recomputed graph
of activation checkpointing (built during backward, after the walk).

It is capture plumbing for :class:`fp16probe.capture.probe.Probe`: it reads the recorder's
state and scale in force through callables and holds no statistics of its own.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


__all__ = ["CAST_VIEW", "CHANNEL", "COVERED", "FP32_ONLY", "CeilingHooks", "mark_covered", "mark_node_covered",
           "step_ceilings"]

CHANNEL = "ceiling"  # the Recorder's per-step maximum this feeds
FP32_ONLY = "fp16probe.fp32_only"  # node.metadata mark (op capture): its gradient stays fp32 under autocast
COVERED = "fp16probe.covered"  # node.metadata: outputs whose gradient a histogram counts whole
CAST_VIEW = "fp16probe.cast_view"  # node.metadata: a view the dtype tracking made for a would-be cast

_KEY = "fp16probe.ceiling"  # node.metadata entry marking a node hooked in the current generation
_WALK = "fp16probe.walk"  # node.metadata entry marking a node visited in the current walk
_POPS = "fp16probe.edges"  # node.metadata: edges into the node seen in the current walk
_SKIPPED = "fp16probe.passed"  # node.metadata: left unhooked as a layout node's input in this step
_FRESH = "fp16probe.fresh"  # node.metadata: the walk that first reached the node in this step
_MIRROR = "fp16probe.mirror"  # node.metadata: (walk, chain metadata) of a layout node over a covered one
_EXTRA = "fp16probe.extra"  # node.metadata: a later walk of the step found another consumer
_PARAM_COUNTED = "fp16probe.param"  # node.metadata: an AccumulateGrad the weight histograms cover this step
_ACCUMULATE = "AccumulateGrad"
_FOLD_EVERY = 256  # per-gradient extremes (two each) held before folding into the running maximum
_RECHECK_EVERY = 64  # forwards between re-runs of the dtype tracking while its marks are reused


def mark_covered(t: torch.Tensor) -> None:
    """Note that a histogram counts the gradient of ``t`` whole (a gradient hook on ``t``).

    The overflow ceiling takes the histograms' maximum too, so a node whose every output is
    covered needs no hook of its own: it would read the same numbers a second time.
    (:meth:`CeilingHooks.cover` notes it only for a walk that needs it.)
    """
    node = t.grad_fn
    if node is not None:
        mark_node_covered(node, t.output_nr)


def mark_node_covered(node: Any, output_nr: int) -> None:
    """:func:`mark_covered` of output ``output_nr`` of the autograd node ``node``."""
    meta = node.metadata
    got = meta.get(COVERED)
    if got is None:
        meta[COVERED] = {output_nr}
    else:
        got.add(output_nr)


# Backward nodes of ops that only rearrange their one input's elements (same count), or split
# them into outputs that partition them (``unbind``, ``split``, ``chunk``: the qkv of attention):
# the gradient into the input is the outputs' gradients, rearranged (zeros where an output got
# none), with the same maximum.
_LAYOUT_NODES = frozenset(
    {
        "AliasBackward0", "CloneBackward0", "PermuteBackward0", "ReshapeAliasBackward0", "SplitBackward0",
        "SplitWithSizesBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "TBackward0",
        "TransposeBackward0", "TransposeBackward1", "UnbindBackward0", "UnsafeViewBackward0",
        "UnsqueezeBackward0", "ViewBackward0",
    }
)


def _passed_through(node: Any, meta: dict, consumer: Any, token: object) -> bool:
    """Whether ``node``'s gradient is its only consumer's, rearranged, and that consumer is seen.

    The consumer was reached earlier in the same walk, so it is seen (hooked, covered or
    passed through itself) unless its gradient stays fp32. Then ``node``'s maximum is already
    counted; it is marked so that a later walk of the step that finds another consumer of it
    hooks it after all.
    """
    if consumer is None or meta[_POPS] != 1:
        return False
    cmeta = consumer.metadata
    if cmeta.get(FP32_ONLY) or cmeta.get(CAST_VIEW) or consumer.name() not in _LAYOUT_NODES:
        return False
    if sum(1 for n, _ in consumer.next_functions if n is not None) != 1:
        return False
    if not _one_output(node):  # one output: its gradient is all that flows in
        return False
    meta[_SKIPPED] = token
    return True


def _mark_counted_params(order: list[tuple[Any, dict, Any]], counted: frozenset[int], token: object) -> None:
    """Mark as covered the AccumulateGrad nodes of parameters the weight histograms count.

    Only while the parameter has no gradient yet: the first backward's incoming gradient
    then becomes ``.grad`` as it is, and the recorder counts it at the end of that backward
    (and keeps its maximum if a later backward of the step replaces the count). A node
    that already has a gradient to add to keeps its hook; so does one a later walk of the
    step reaches again (``_SKIPPED``).
    """
    for node, meta, _ in order:
        if meta.get(FP32_ONLY) or _ACCUMULATE not in node.name():
            continue
        var = node.variable
        if id(var) in counted and var.grad is None:
            meta[_PARAM_COUNTED] = token
            meta[_SKIPPED] = token


def _mark_mirrors(order: list[tuple[Any, dict, Any]], walk: object) -> None:
    """Mark each layout node whose gradient has the maximum of a covered node down a chain.

    A layout node ``C`` with one input ``N`` that this walk reached from ``C`` alone, with
    one output, is ``N``'s gradient rearranged; when ``N`` is covered by a histogram, or is
    such a node itself, ``C``'s maximum is counted. ``meta[_MIRROR]`` holds the walk and the
    metadata of the chain below ``C``: another consumer of any of them breaks the equality.
    Children come after their only consumer in the walk, so the walk runs backwards here.
    """
    for node, meta, _ in reversed(order):
        if meta.get(FP32_ONLY) or meta.get(CAST_VIEW) or node.name() not in _LAYOUT_NODES:
            continue
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            continue
        child = nexts[0].metadata
        if child.get(_FRESH) is not walk or child[_POPS] != 1 or child.get(FP32_ONLY):
            continue
        below = child.get(_MIRROR)
        if below is not None and below[0] is walk:
            meta[_MIRROR] = (walk, [child, *below[1]])
        elif _covered(nexts[0], child) and _one_output(nexts[0]):
            meta[_MIRROR] = (walk, [child])


def _unless_consumed_elsewhere(
    hook: Callable[[tuple[Any, ...]], None], chain: list[dict], token: object
) -> Callable[[tuple[Any, ...]], None]:
    """``hook``, run only when a later walk found another consumer of a node down ``chain``."""

    def prehook(grad_outputs: tuple[Any, ...]) -> None:
        for meta in chain:
            if meta.get(_EXTRA) is token:
                hook(grad_outputs)
                return

    return prehook


def _one_output(node: Any) -> bool:
    try:
        return len(node._input_metadata) == 1
    except Exception:  # a torch without Node._input_metadata: the safe side
        return False


def _covered(node: Any, meta: dict) -> bool:
    if _PARAM_COUNTED in meta and meta[_PARAM_COUNTED] is meta.get(_KEY):  # counted in this step
        return True
    got = meta.get(COVERED)
    if not got:
        return False
    try:
        return len(got) == len(node._input_metadata)  # every output of the node
    except Exception:  # a torch without Node._input_metadata: hook it, the safe side
        return False


def _roots(tensors: Iterable[Any]) -> list[Any]:
    """The autograd nodes that made ``tensors`` (those with a graph)."""
    return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _lean_walk(roots: list[Any]) -> tuple[list[Any], list[Any]]:
    """The nodes behind ``roots`` in the full walk's first-visit order, and a trace of the walk.

    The trace holds, per pop, the node's type and its number of inputs when first seen, or
    the position of the node seen before: equal traces are the same graph (types and edges)
    visited the same way. No metadata is touched (reading ``node.metadata`` makes a dict).
    """
    nodes: list[Any] = []
    trace: list[Any] = []
    position: dict[Any, int] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        i = position.get(node)
        if i is not None:
            trace.append(i)
            continue
        position[node] = len(nodes)
        nodes.append(node)
        before = len(stack)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                stack.append(nxt)
        trace.append((type(node), len(stack) - before))
    return nodes, trace


class _Plan:
    """The hooks of a step's first walk, by position in walk order, and what they depended on."""

    __slots__ = ("trace", "hooked", "params", "marks", "counted")

    def __init__(self, trace: list[Any], hooked: list[int], params: list[tuple[int, bool]],
                 marks: Any, counted: frozenset[int]) -> None:
        self.trace = trace
        self.hooked = hooked
        self.params = params  # (position, gradient was None) of the counted parameters' nodes
        self.marks = marks
        self.counted = counted


class CeilingHooks:
    """Feed the largest unscaled |gradient| of every autograd node into a per-step maximum.

    ``enabled()`` says whether the owner records now (started and sampling);
    ``inv_scale(device)`` gives the reciprocal of the loss scale in force as a device
    tensor (None when the gradients are not scaled); ``note_max(value)`` folds a device
    scalar into the step's maximum; ``on_error`` takes an exception a hook caught, so
    bookkeeping never breaks training. The owner calls :meth:`close_step` at each step
    boundary, before it closes its own step.
    """

    def __init__(
        self,
        enabled: Callable[[], bool],
        inv_scale: Callable[[torch.device], torch.Tensor | None],
        note_max: Callable[[torch.Tensor], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._enabled = enabled
        self._inv_scale = inv_scale
        self._note_max = note_max
        self._on_error = on_error
        self._lock = threading.Lock()
        self._token = object()  # a new one per step: nodes hooked in an older step re-hook
        self._pending: list[torch.Tensor] = []  # per-gradient min and max (scaled), not yet folded
        self._scale_read = False
        self._lasting: list[Any] = []  # handles of hooks on nodes shared between graphs
        self.nodes_hooked = 0  # nodes hooked over the Probe's life
        self.nodes_mirrored = 0  # nodes hooked only in case a later walk finds another consumer
        # ids of parameters whose gradient the weight histograms count at the end of each
        # backward (the owner sets it; empty under DDP, which all-reduces first).
        self.counted_params: frozenset[int] = frozenset()
        # Reusing the dtype tracking's marks (see begin_forward): the marks of the last
        # forward it ran on, as (node type, fp32 only) in walk order.
        self._marks: list[tuple[type, bool]] | None = None
        self._tracked_now = False  # the dtype tracking runs for the forward being watched
        self._since_tracked = 0
        self._reuse_ok = True  # False once two tracked forwards of one graph disagreed
        self.forwards_tracked = 0
        self.forwards_reused = 0
        # Replaying the hook set (see _replay): the plan of the last full first walk, the step
        # token of this step's first walk, and what a replay registered (undone if another walk comes).
        self._plan: _Plan | None = None
        self._walked: object | None = None
        self._multi_walk = False  # this step has more than one walk
        self._multi_walk_last = False  # the last step had
        self._replayed: tuple[list[Any], list[Any]] | None = None  # (root nodes, handles) of this step's replay
        self.forwards_replayed = 0
        self._covers: list[tuple[Any, int]] = []  # (node, output_nr) the histograms count, not marked yet

    def cover(self, node: Any, output_nr: int) -> None:
        """:func:`mark_node_covered`, written on the node only when a full walk needs it: a replayed step reads
        no marks, and reading ``node.metadata`` makes a dict (a microsecond an output, in every forward hook)."""
        self._covers.append((node, output_nr))

    # -- dtype marks -------------------------------------------------------------------
    def begin_forward(self) -> bool:
        """Say whether the dtype tracking must run for the model forward that starts now.

        The tracking (a ``TorchFunctionMode`` over every op, :mod:`fp16probe.capture.ops`)
        costs tens of microseconds per op. Its marks depend on the graph, which is the same
        from step to step in most models, so they are kept in walk order and reused on
        forwards whose graph has the same node types in the same order. It runs again when
        the graph changes, every ``_RECHECK_EVERY`` forwards, and always once two tracked
        forwards of the same graph disagreed.
        """
        run = self._marks is None or not self._reuse_ok or self._since_tracked >= _RECHECK_EVERY
        self._since_tracked = 0 if run else self._since_tracked + 1
        self._tracked_now = run
        return run

    # -- graph walk (forward side: Python only, no device work) ----------------------
    def watch(self, tensors: Iterable[Any], *, model_output: bool = False) -> None:
        """Hook every autograd node behind ``tensors`` not yet hooked in this step.

        ``model_output``: the tensors are the probed model's outputs, watched right after its
        forward; the dtype marks are then recorded (the tracking ran) or reused (it did not).

        A node gets no hook of its own when its gradient stays fp32 under autocast (the
        dtype marks), when a histogram counts its every output gradient (its maximum is in
        the histograms'), or when its only consumer in the graph is a layout node
        (``view``, ``t``, ``permute``, ...) with no other input that is itself seen: its
        gradient is that node's, rearranged, with the same maximum. A later walk in the step
        (:meth:`watch` on the loss) that reaches such a node through another consumer hooks it.
        The other way round, a layout node whose one input is consumed by it alone and is
        covered by a histogram (directly or down a chain of such nodes) has the same maximum
        as that input: its hook reads nothing unless a later walk found another consumer
        somewhere down the chain.
        """
        if not self._enabled():
            return
        try:
            roots = _roots(tensors)
            token = self._token
            if not roots:  # no graph (a forward under no_grad): nothing to hook, the marks stay as they are
                self._tracked_now = False
                return
            if self._walked is token:  # a later walk of the step: the first one's marks must be on its nodes
                self._multi_walk = True
                if self._replayed is not None:
                    self._undo_replay(token)
            elif model_output:
                self._walked = token
                nodes, trace = _lean_walk(roots)
                if self._replay(roots, nodes, trace, token):
                    return
                self._plan = self._new_plan(nodes, trace, self._full_walk(roots, model_output, token))
                return
            else:
                self._walked = token
            self._full_walk(roots, model_output, token)
        except Exception as e:  # a node type without hooks or metadata: note it, go on
            self._on_error(e)

    def _full_walk(self, roots: list[Any], model_output: bool, token: object) -> list[Any]:
        """Walk the graph behind ``roots`` with every rule of :meth:`watch`; return the nodes given a plain hook."""
        covers, self._covers = self._covers, []
        for node, output_nr in covers:
            mark_node_covered(node, output_nr)
        order, walk = self._walk(roots, model_output, token)
        hook = self._hook(token)
        if self.counted_params:
            _mark_counted_params(order, self.counted_params, token)
        _mark_mirrors(order, walk)
        hooked = []
        for node, meta, consumer in order:
            if meta.get(FP32_ONLY):
                continue
            if _covered(node, meta) or _passed_through(node, meta, consumer, token):
                continue
            chain = meta.get(_MIRROR)
            if chain is not None and chain[0] is walk:
                self._register(node, _unless_consumed_elsewhere(hook, chain[1], token))
                self.nodes_mirrored += 1
            else:
                self._register(node, hook)
                self.nodes_hooked += 1
                hooked.append(node)
        return hooked

    # -- replaying the hook set while the graph repeats ----------------------------------
    def _new_plan(self, nodes: list[Any], trace: list[Any], hooked: list[Any]) -> _Plan:
        """What the first walk of this step did, by position in walk order, to replay on the same graph."""
        position = {node: i for i, node in enumerate(nodes)}
        counted = self.counted_params
        params = []
        if counted:
            for i, node in enumerate(nodes):
                if _ACCUMULATE in node.name() and id(node.variable) in counted:
                    params.append((i, node.variable.grad is None))
        return _Plan(trace, [position[n] for n in hooked], params, self._marks, counted)

    def _replay(self, roots: list[Any], nodes: list[Any], trace: list[Any], token: object) -> bool:
        """Hook the nodes the last plan hooked, by position, when this is the same graph in the same state.

        The full walk's decisions depend on the graph (node types and edges: ``trace``), the
        dtype marks, the histograms' coverage (made by the same module hooks on the same
        graph) and, for parameters the weight histograms count, whether their gradient is
        still None: all compared here. Nodes hooked only in case a later walk of the step
        finds another consumer (mirrors) are left out: if a later walk comes, the replay is
        undone and the full walk runs first (:meth:`_undo_replay`). Steps after one with
        several walks do not replay.
        """
        plan = self._plan
        if (plan is None or self._tracked_now or self._multi_walk_last or plan.marks is not self._marks
                or plan.counted is not self.counted_params or plan.trace != trace):
            return False
        for i, was_none in plan.params:
            if (nodes[i].variable.grad is None) is not was_none:
                return False
        hook = self._hook(token)
        handles = [self._register(nodes[i], hook) for i in plan.hooked]
        self.nodes_hooked += len(handles)
        if self._marks is not None:
            self.forwards_reused += 1  # as the full walk counts a forward on reused marks
        self.forwards_replayed += 1
        self._replayed = (roots, handles)
        return True

    def _undo_replay(self, token: object) -> None:
        """Another walk came in a replayed step: remove the replayed hooks and walk the first graph in full."""
        roots, handles = self._replayed  # type: ignore[misc]
        self._replayed = None
        for h in handles:
            h.remove()
        self.nodes_hooked -= len(handles)
        self._full_walk(roots, True, token)
        if self._marks is not None:
            self.forwards_reused -= 1  # counted once, by the replay
        self.forwards_replayed -= 1

    def _walk(
        self, roots: list[Any], model_output: bool, token: object
    ) -> tuple[list[tuple[Any, dict, Any]], object]:
        """Visit the graph behind the ``roots`` nodes; return the nodes new in this step, each with its consumer.

        Sets the dtype marks on reused forwards and records them on tracked ones. Counts, in
        ``meta[_POPS]``, the edges into each node from this walk (a root counts twice: code
        outside the graph consumes it). A node an earlier walk of the step saw, reached
        again, has a consumer that walk did not see: it is marked (``_EXTRA``), and hooked if
        that walk left it unhooked. Also returns this walk's identity (``meta[_WALK]``).
        """
        walk = object()
        order: list[tuple[Any, dict, Any]] = []
        stack: list[tuple[Any, Any]] = [(node, None) for node in roots]
        record = model_output and self._tracked_now
        marks = self._marks if model_output and not self._tracked_now else None
        self._tracked_now = False
        seen: list[tuple[type, bool]] = []
        while stack:
            node, consumer = stack.pop()
            meta = node.metadata
            if meta.get(_WALK) is walk:
                meta[_POPS] += 1
                continue
            meta[_WALK] = walk
            meta[_POPS] = 1 if consumer is not None else 2
            if (record or marks is not None) and not meta.get(CAST_VIEW):  # only tracked graphs have those
                # The marks go by first visit in this walk, which depends on the graph alone.
                i = len(seen)
                if marks is not None:
                    if i < len(marks) and type(node) is marks[i][0]:
                        if marks[i][1]:
                            meta[FP32_ONLY] = True
                    else:  # another graph: count the rest (the safe side), track the next forward
                        marks = self._marks = None
                seen.append((type(node), bool(meta.get(FP32_ONLY))))
            if meta.get(_KEY) is token:
                meta[_EXTRA] = token
                if meta.pop(_SKIPPED, None) is token:
                    self._register(node, self._hook(token))
                    self.nodes_hooked += 1
                continue
            meta[_KEY] = token
            meta[_FRESH] = walk
            order.append((node, meta, consumer))
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    stack.append((nxt, node))
        if record:
            self.forwards_tracked += 1
            old = self._marks
            if old is not None and [t for t, _ in old] == [t for t, _ in seen] and old != seen:
                self._reuse_ok = False  # same graph, other marks: the dtypes hang on more than the graph
            self._marks = seen or None
        elif marks is not None:
            self.forwards_reused += 1
            if len(seen) != len(marks):
                self._marks = None  # a longer or shorter graph: track the next forward
        return order, walk

    def _register(self, node: Any, hook: Callable[[tuple[Any, ...]], None]) -> Any:
        handle = node.register_prehook(hook)
        if _ACCUMULATE in node.name():
            # A parameter's AccumulateGrad node outlives a graph while another holds it (the
            # next forward runs before the last loss is freed): unhook it at the step's end,
            # or its hooks would pile up step after step.
            self._lasting.append(handle)
        return handle

    def _hook(self, token: object) -> Callable[[tuple[Any, ...]], None]:
        def prehook(grad_outputs: tuple[Any, ...]) -> None:
            if token is not self._token or not self._enabled():
                return
            try:
                extremes = []
                for g in grad_outputs:
                    if g is None or not isinstance(g, torch.Tensor) or not g.is_floating_point() or g.is_sparse:
                        continue
                    if hasattr(g, "to_local"):  # a DTensor (FSDP2, tensor parallel): this rank's shard
                        g = g.to_local()
                    if g.numel() <= 1:
                        # Scalars are the loss side's own arithmetic (the seed d loss/d loss = 1,
                        # loss * w, loss1 + loss2): fp32 under autocast, where losses and
                        # reductions run in fp32; the scaled loss is kept finite by capping S.
                        continue
                    # One pass, no |g| copy, NaN propagates: 5-30x faster on the CPU than
                    # vector_norm(inf) or abs().amax(); max |g| = max(-min, max) at the fold.
                    lo, hi = torch.aminmax(g.detach())
                    extremes.append(lo)
                    extremes.append(hi)
                if extremes:
                    with self._lock:
                        if not self._scale_read:
                            # Read the scale while backward runs: a scaler's update() after
                            # backward changes its scale tensor in place.
                            self._inv_scale(extremes[0].device)
                            self._scale_read = True
                        self._pending.extend(extremes)
                        if len(self._pending) >= _FOLD_EVERY:
                            self._fold()
            except Exception as e:
                self._on_error(e)

        return prehook

    # -- device-side folding (caller holds the lock) ---------------------------------
    def _fold(self) -> None:
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for m in pending:
            by_device.setdefault(m.device, []).append(m)
        for device, ms in by_device.items():
            top = torch.stack([m.float() for m in ms]).abs().amax()  # amax propagates NaN
            inv = self._inv_scale(device)
            if inv is not None:
                top = top * inv.reshape(())
            self._note_max(top)

    def flush(self) -> None:
        """Fold what the open step saw so far into the owner's maximum (no host sync)."""
        with self._lock:
            if self._pending:
                self._fold()

    def close_step(self) -> None:
        """Fold the open step's gradients and re-arm the hooks for the next step."""
        with self._lock:
            if self._pending:
                self._fold()
            self._scale_read = False
            self._token = object()
            self._covers = []
            self._unhook_lasting()
            self._multi_walk_last, self._multi_walk = self._multi_walk, False
            self._replayed = None

    def remove(self) -> None:
        """Remove the hooks left on nodes that outlive a graph (the Probe's stop() calls it)."""
        with self._lock:
            self._unhook_lasting()

    def _unhook_lasting(self) -> None:
        handles, self._lasting = self._lasting, []
        for h in handles:
            h.remove()


def step_ceilings(
    node_max: Sequence[float], step_max: Sequence[float], found_inf: Sequence[bool]
) -> tuple[float, ...]:
    """Per step: the larger of the nodes' maximum and the histograms' maximum; inf on inf/NaN."""
    out = []
    for nodes, hist, inf in zip(node_max, step_max, found_inf):
        out.append(math.inf if inf or not math.isfinite(nodes) else max(nodes, hist))
    return tuple(out)

