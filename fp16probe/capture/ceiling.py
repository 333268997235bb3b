"""The overflow ceiling: the largest gradient magnitude backward produces anywhere, per step.

Module hooks see only the outputs of the modules that run. The loss scale multiplies every
gradient in backward: the gradient of the loss with respect to the model's output, the
gradients of functional code between and after modules (``out * gain``,
``logits / temperature``), module internals that bypass a submodule's forward
(``nn.MultiheadAttention`` uses ``out_proj.weight`` directly) and the weight gradients.
Every one of them is the input of some autograd node. So after each probed forward the
graph behind the model's outputs (and, through :meth:`Ceiling.watch`, behind the loss) is
walked once, and every node gets a pre-hook that keeps only ``max |g|`` of the gradients
flowing into it: one reduction per node, on the gradient's device, folded into one running
maximum per step (the Recorder's ``note_max``). Nothing here brings a value to the host.

With op-level capture, nodes whose gradient stays fp32 under autocast (marked by
:mod:`fp16probe.capture.ops`) are walked through but not counted. Scalar gradients are left out: they are the loss side's own arithmetic (the seed
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

__all__ = ["CHANNEL", "FP32_ONLY", "Ceiling", "step_ceilings"]

CHANNEL = "ceiling"  # the Recorder's per-step maximum this feeds
FP32_ONLY = "fp16probe.fp32_only"  # node.metadata mark (op capture): its gradient stays fp32 under autocast

_KEY = "fp16probe.ceiling"  # node.metadata entry marking a node hooked in the current generation
_ACCUMULATE = "AccumulateGrad"
_FOLD_EVERY = 256  # per-gradient extremes (two each) held before folding into the running maximum


class Ceiling:
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

    # -- graph walk (forward side: Python only, no device work) ----------------------
    def watch(self, tensors: Iterable[Any]) -> None:
        """Hook every autograd node behind ``tensors`` not yet hooked in this step."""
        if not self._enabled():
            return
        try:
            token = self._token
            stack = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            hook = self._hook(token)
            while stack:
                node = stack.pop()
                meta = node.metadata
                if meta.get(_KEY) is token:
                    continue
                meta[_KEY] = token
                if not meta.get(FP32_ONLY):  # op capture found it never holds fp16 under autocast
                    handle = node.register_prehook(hook)
                    if _ACCUMULATE in node.name():
                        # A parameter's AccumulateGrad node outlives a graph while another holds
                        # it (the next forward runs before the last loss is freed): unhook it at
                        # the step's end, or its hooks would pile up step after step.
                        self._lasting.append(handle)
                    self.nodes_hooked += 1
                for nxt, _ in node.next_functions:
                    if nxt is not None:
                        stack.append(nxt)
        except Exception as e:  # a node type without hooks or metadata: note it, go on
            self._on_error(e)

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
            self._unhook_lasting()

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
