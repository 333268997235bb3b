"""Callbacks that attach a Probe to the training loops people already run.

The frameworks are optional extras, imported only when a callback module is imported:
``fp16probe.integrations.huggingface`` (``pip install fp16probe[hf]``) and
``fp16probe.integrations.lightning`` (``pip install fp16probe[lightning]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp16probe.errors import require

__all__ = ["REPORT_NAME", "RECOMMENDATION_NAME", "finish", "require", "write_outputs"]

REPORT_NAME = "fp16probe-report.json"  # the command line's default too
RECOMMENDATION_NAME = "fp16probe-recommendation.txt"


def write_outputs(report: Any, folder: str | Path) -> Any:
    """Write ``report`` (REPORT_NAME) and its recommendation's text (RECOMMENDATION_NAME) into ``folder``.

    Returns the report as written.
    """
    from fp16probe.report import atomic_write_text

    folder = Path(folder)
    report.save(folder / REPORT_NAME)
    text = report.recommendation.text if report.recommendation is not None else ""
    atomic_write_text(folder / RECOMMENDATION_NAME, text.rstrip("\n") + "\n")
    return report


def finish(probe: Any, *, trainer: str, global_step: int, is_main: bool, folder: str | Path,
           format: str = "fp16", extra: dict[str, Any] | None = None) -> Any:
    """Stop ``probe``, merge every rank's statistics, analyse and write them on the main process.

    The same last step as :func:`fp16probe.profile` (``running.profile.conclude``). Every rank
    must call it (the merge is a collective). Returns the report as written on the main
    process, None elsewhere.
    """
    from fp16probe.running.profile import conclude

    probe.stop()
    meta = {"trainer": trainer, "global_step": int(global_step), **(extra or {})}
    report = conclude(probe, extra=meta, format=format)
    if report is None or not is_main:
        return None
    return write_outputs(report, folder)
