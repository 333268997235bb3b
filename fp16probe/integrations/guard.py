"""The plain Probe's rank guard for training loops that a framework runs (the HF Trainer, Lightning).

:func:`fp16probe.profile` owns its loop, so its ranks agree before every backward and settle
after a stop (:mod:`fp16probe.running.ranks`). A callback owns no loop: the guard agrees
where the framework lets it in. Every rank agrees once per training forward, before
backward (Lightning's ``on_before_backward``; for the Trainer, a forward hook on the model),
and once when training ends. The failing rank joins that agreement from where it learns
of its own failure (Lightning's ``on_exception``; for the Trainer, the same forward hook,
which torch runs even when the forward raises), so a rank that fails before backward stops
every rank at that step without any timeout. The ranks then exchange the failing rank's
message, rank 0 writes the report of the steps every rank finished (or its own, marked),
and the ranks leave together: torchrun ends the whole job when the first rank exits, so
no rank leaves before rank 0 has written.

A failure no agreement can catch (inside backward, where the other ranks wait in DDP's
all-reduce on the framework's own process group) is bounded by that group's timeout and by
the control group's (twice ``$FP16PROBE_DIST_TIMEOUT``); with gloo a rank that exits also
breaks its peers' waits at once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from fp16probe.errors import Fp16ProbeError, ModelError, first_line

__all__ = ["CallbackGuard", "Stop", "rank_guard"]

# How a callback settles a stop: (this rank's error or None, statuses, finished steps per rank) -> the error to raise.
Stop = Callable[[BaseException | None, tuple[int, ...], tuple[int, ...]], "Fp16ProbeError | None"]


def rank_guard(model: Any) -> "CallbackGuard | None":
    """Under torch.distributed, a guard for ``model`` (a collective: every rank, same point); else None."""
    from fp16probe.capture import distributed

    if not distributed.is_distributed():
        return None
    return CallbackGuard(model)


class CallbackGuard:
    """One :class:`~fp16probe.running.ranks.RankGuard` and how a callback stops on it.

    Args:
        model: the model every rank trains; the ranks refuse to start when theirs differ.
    """

    def __init__(self, model: Any) -> None:
        from fp16probe.running.ranks import RankGuard

        self.ranks = RankGuard()
        self.ranks.check_same_model(model)
        self.stopped = False  # this rank has settled a stop: nothing more to agree on
        self._handle: Any = None

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.ranks.rank

    def check(self, done: int, stop: Stop) -> None:
        """Agree that every rank got this far; when one did not, settle (``stop``) and raise its error."""
        if self.stopped:
            return
        statuses, finished = self.ranks.agree(done)
        if any(statuses):
            raise stop(None, statuses, finished) or ModelError(f"rank {self.rank}: another rank stopped the run")

    def failed(self, done: int, error: BaseException, stop: Stop) -> Fp16ProbeError | None:
        """This rank failed: join the others' next agreement with its status, then settle (``stop``).

        Returns the error the ranks settled on (the failing rank's, named), or None.
        """
        from fp16probe.running.ranks import status_of

        if self.stopped:
            return None
        statuses, finished = self.ranks.agree(done, status_of(_as_probe_error(error)))
        return stop(error, statuses, finished)

    def settle(self, error: BaseException | None, statuses: tuple[int, ...], finished: tuple[int, ...], *,
               done: int, report: Callable[[dict[str, Any], Any], Any],
               write: Callable[[Any], Path]) -> Fp16ProbeError | None:
        """After a stop: exchange messages, make the report of the finished steps, leave together.

        ``report(extra, group)`` makes the report (a collective over ``group``, or this
        rank's own with ``group="local"``); rank 0 writes it with ``write``, which returns
        its path. Returns the error every rank raises (the failing rank's, named), or None.
        """
        from fp16probe.running import ranks

        self.stopped = True
        said = f"{type(error).__name__}: {first_line(error)}" if error is not None else self.ranks.failure
        settled = self.ranks.settle(statuses, finished, said)
        failure = settled.error(self.rank)
        meta: dict[str, Any] = {"rank_fault": {"rank": settled.cause, "steps_finished_per_rank": list(finished),
                                               "lost_contact": settled.broken}}
        made = None
        if settled.same_steps:
            if finished[0] > 0:
                made = report(meta, self.ranks.group)
        elif self.rank == 0 and done > 0:
            meta["ranks_in_report"] = [0]
            meta["notes"] = [f"only rank 0's own {done} step(s): " + (
                "the other ranks could not be reached" if settled.broken
                else f"the ranks finished {', '.join(map(str, finished))} step(s)")]
            made = report(meta, "local")
        written = write(made) if made is not None and self.rank == 0 else None
        if not self.ranks.broken:  # hold every rank until rank 0 has written: torchrun ends the job on the first exit
            self.ranks.agree(done, ranks.STOPPED)
        if failure is not None and written is not None:
            failure = type(failure)(f"{failure}; the {made.metadata.steps_seen} step(s) before it are in the "
                                    f"partial report {written}")
        if failure is not None and error is not None and failure is not error:
            failure.__cause__ = error
        return failure

    def hook_forward(self, model: Any, on_forward: Callable[[BaseException | None], None]) -> None:
        """Call ``on_forward(error)`` after every training forward of ``model``, also when it raised."""
        def hook(module: Any, args: Any, output: Any) -> None:
            if not module.training or not _grad_enabled():
                return  # evaluation and no-grad forwards have no backward to guard
            on_forward(sys.exc_info()[1])

        self._handle = model.register_forward_hook(hook, always_call=True)

    def close(self) -> None:
        """Remove the forward hook, if any."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _as_probe_error(error: BaseException) -> Any:
    """``error`` as :func:`~fp16probe.running.ranks.status_of` reads it (the user's code's: MODEL)."""
    if isinstance(error, Fp16ProbeError):
        return error
    wrapped = ModelError(first_line(error))
    wrapped.__cause__ = error
    return wrapped
