"""Keep the ranks of a distributed profile in step, so that one failing rank stops them all.

Without this, a rank that fails waits in the report gather while the others wait in DDP's
gradient all-reduce, and the job hangs until something outside kills it. The
:class:`RankGuard` adds one small all-reduce per step on a control process group of its own
(gloo, on the CPU) just before backward, where every rank says whether it got a batch and
ran its forward and loss. A rank that fails before backward (its batches, its forward, its
loss) makes every rank stop at that step without any timeout. A failure no agreement can
catch (inside backward or the optimizer, a rank killed) is bounded by the process group's
timeout (``FP16PROBE_DIST_TIMEOUT``, 60 s by default): a rank that waited that long in a
collective gives up, and the ranks then settle on the control group, whose own timeout is
twice that. After a stop, every rank learns which rank failed and why (one gather of the
messages), and rank 0 gets the merged report of the steps every rank finished, or its own
steps (marked) when the ranks did not finish the same number or a rank was lost.

The control group stays usable when the default group is broken by a timeout (gloo closes
the pair), which is why every collective after a stop runs on it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from fp16probe.errors import Fp16ProbeError, InputError, ModelError, first_line

__all__ = ["DEFAULT_TIMEOUT_S", "RankGuard", "Settled", "TIMEOUT_ENV", "is_collective_error", "joined_from_env",
           "status_of", "timeout_s"]

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "FP16PROBE_DIST_TIMEOUT"

# What a rank says at each agreement (the largest wins when several ranks stop).
OK = 0
EXHAUSTED = 1  # its batches ran out
STOPPED = 2  # Ctrl-C, SIGTERM or SIGHUP
LOST = 3  # a collective failed or timed out: another rank stopped answering
INPUT = 4  # its batches or its inputs raised (InputError)
MODEL = 5  # its model, loss, backward or optimizer raised (ModelError)

# torch.distributed backends phrase a dead or silent peer like this (gloo, NCCL, c10d).
_COLLECTIVE = re.compile(r"gloo|nccl|c10d|connection (closed|reset)|timed out|pair closure|broken pipe", re.IGNORECASE)


def timeout_s() -> float:
    """The bound on any one wait for the other ranks, in seconds: ``$FP16PROBE_DIST_TIMEOUT`` or 60."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < 86400):
        raise InputError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds between 0 and 86400, e.g. 60")
    return value


def is_collective_error(e: BaseException) -> bool:
    """Whether ``e`` says a collective failed (a peer died or stayed silent), not the user's code."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and bool(_COLLECTIVE.search(str(e).splitlines()[0] if str(e) else ""))


@dataclass(frozen=True)
class Settled:
    """What the ranks agreed on after a stop: each rank's status, finished steps and message."""

    statuses: tuple[int, ...]
    done: tuple[int, ...]
    messages: tuple[str, ...] | None  # None when the messages could not be exchanged
    broken: bool  # a control collective failed: no further collective is possible
    own: str = ""  # this rank's own message, known even when the exchange failed

    @property
    def same_steps(self) -> bool:
        """Whether every rank finished the same number of steps (a merged report is possible)."""
        return not self.broken and len(set(self.done)) == 1

    @property
    def cause(self) -> int | None:
        """The rank whose failure stopped the run (the worst status, lowest rank), or None."""
        worst = max(self.statuses)
        if worst == OK or all(s == EXHAUSTED for s in self.statuses):  # nobody failed, or all ran out together
            return None
        return self.statuses.index(worst)

    def error(self, me: int) -> Fp16ProbeError | None:
        """The error every rank raises: the failing rank's, named; None when nothing failed."""
        cause = self.cause
        if cause is None:
            return None
        status = self.statuses[cause]
        if self.messages is None:  # no word from the others: say what this rank saw
            others = [r for r in range(len(self.statuses)) if r != me]
            return ModelError(f"rank {me} lost contact with rank {', '.join(map(str, others))}: "
                              f"{self.own or 'a collective failed'}; rank {me} stopped")
        said = self.messages[cause]
        if status == EXHAUSTED:  # some ranks ran out of batches, others did not
            short = min(self.done)
            ran_out = [r for r, s in enumerate(self.statuses) if s == EXHAUSTED]
            return InputError(
                f"rank {', '.join(map(str, ran_out))}: the batches ran out after {short} step(s) while other ranks "
                "had more; every rank stopped there: give each rank the same number of batches"
            )
        if status == STOPPED:
            return None  # the interruption speaks for itself (exit 130, 143 or 129)
        if status == LOST:
            return ModelError(f"rank {cause}: {said or 'lost contact with the other ranks'}; every rank stopped")
        kind = InputError if status == INPUT else ModelError
        return kind(f"rank {cause}: {said}; every rank stopped")


_GROUPS: dict[tuple[int, float], Any] = {}


@contextlib.contextmanager
def joined_from_env() -> Iterator[bool]:
    """Join the process group torchrun describes (``timeout_s()`` bounds its waits) for one run; yield whether distributed.

    A group this joined is destroyed on the way out, on every path: a process that exits with
    gloo's groups alive leaves their threads to interpreter shutdown, which now and then aborts
    it ("terminate called without an active exception", SIGABRT) after a run that succeeded.
    A group the caller made before stays theirs.
    """
    from fp16probe.capture import distributed

    made = not distributed.is_distributed()
    joined = distributed.init_from_env(timeout=timeout_s())
    try:
        yield joined
    finally:
        if made and distributed.is_distributed():
            import torch.distributed as dist

            _GROUPS.clear()  # the control groups go with the default group
            dist.destroy_process_group()


class RankGuard:
    """One control process group and the agreements on it (see the module docstring).

    Every rank must create it at the same point (it is a collective), after the default
    process group exists.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.timeout = timeout_s()
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        # Twice the default group's timeout: a rank stuck there for the whole timeout still
        # finds the others waiting on this group. One per process and timeout (a group is
        # never freed before the default group is), made by every rank in the same order.
        key = (self.size, self.timeout)
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * self.timeout))
        self.group = _GROUPS[key]
        self._key = key
        self.broken = False
        self.failure = ""  # what the control collective that failed said

    def _break(self) -> None:
        """A control collective failed: no more collectives here, and the next guard makes a new group."""
        self.broken = True
        _GROUPS.pop(self._key, None)

    def check_same_model(self, model: torch.nn.Module) -> None:
        """Refuse, on every rank at once, models whose parameters differ between ranks.

        DDP's own check fails on one rank and leaves the others waiting for the timeout;
        one gather of the parameter shapes answers on every rank in milliseconds.
        """
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
        every: list[Any] = [None] * self.size
        try:
            self._dist.all_gather_object(every, mine, group=self.group)
        except RuntimeError as e:
            self._break()
            raise ModelError(f"rank {self.rank}: the other ranks did not answer while comparing models: "
                             f"{first_line(e)}") from e
        for r, theirs in enumerate(every):
            if theirs != every[0]:
                error = ModelError(f"rank {r} built a different model from rank 0: "
                                   f"{_first_difference(every[0], theirs)}; every rank must build the same model "
                                   "(same MODEL, --weights and flags)")
                error.reported_elsewhere = self.rank != 0  # every rank knows; rank 0 says it
                raise error

    def agree(self, done: int, status: int = OK) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One small all-reduce: every rank's status and finished steps. A failure: this rank is LOST."""
        t = torch.zeros(2 * self.size, dtype=torch.int64)
        t[self.rank] = status
        t[self.size + self.rank] = done
        if self.broken:
            t[self.rank] = max(status, LOST)
            return tuple(t[: self.size].tolist()), tuple(t[self.size:].tolist())
        try:
            self._dist.all_reduce(t, group=self.group)
        except RuntimeError as e:
            self._break()
            self.failure = f"after {done} step(s), the ranks' agreement failed ({first_line(e)})"
            t[self.rank] = max(status, LOST)
            t[:self.rank] = LOST  # no word from the others: count them lost too
            t[self.rank + 1:self.size] = LOST
        values = t.tolist()
        return tuple(values[: self.size]), tuple(values[self.size:])

    def settle(self, statuses: tuple[int, ...], done: tuple[int, ...], message: str) -> Settled:
        """After a stop every rank knows of: exchange the messages (one gather), when the group still works."""
        messages: tuple[str, ...] | None = None
        if not self.broken:
            every: list[Any] = [None] * self.size
            try:
                self._dist.all_gather_object(every, message, group=self.group)
                messages = tuple(str(m) for m in every)
            except RuntimeError as e:
                self._break()
                self.failure = self.failure or f"exchanging the ranks' messages failed ({first_line(e)})"
        return Settled(statuses, done, messages, self.broken, message)


def status_of(error: BaseException | None, *, exhausted: bool = False, stopped: bool = False) -> int:
    """The status a rank reports for how its loop ended."""
    if error is not None:
        if isinstance(error, InputError):
            return INPUT
        return LOST if is_collective_error(error.__cause__ or error) else MODEL
    if stopped:
        return STOPPED
    return EXHAUSTED if exhausted else OK


def _first_difference(a: list[Any], b: list[Any]) -> str:
    if len(a) != len(b):
        return f"{len(b)} parameter tensors against {len(a)}"
    for (na, sa, da), (nb, sb, db) in zip(a, b):
        if (na, sa, da) != (nb, sb, db):
            return f"parameter {nb} is {list(sb)} {db}, rank 0's {na} is {list(sa)} {da}"
    return "the parameters differ"
