"""Send a report's histograms and scalars to the trackers people already watch.

TensorBoard (``pip install 'fp16probe[tensorboard]'``), Weights & Biases
(``'fp16probe[wandb]'``) and MLflow (``'fp16probe[mlflow]'``); each package is imported only
when its exporter is used, and its absence raises one line naming the extra.

What is logged (the same for every tracker; MLflow has no histogram type and gets the
figures and an HTML report as artifacts instead):

* histograms ``fp16probe/<kind>``: per profiled step, the exact log2 histogram of that kind.
  Bucket ``(e - 1, e]`` holds the magnitudes in ``(2^(e-1), 2^e]``, the report's own bins,
  one bucket per bin from the lowest to the highest occupied one. Zeros, infinities and
  NaNs are counted apart (scalars ``zero_fraction``, ``nonfinite``), since log2 of 0 has
  no bucket. With ``modules=True`` also ``fp16probe/<kind>/<module>``: each module's
  histogram over all steps so far, at the last step.
* scalars ``fp16probe/<kind>/...`` per step: ``flushed_fraction_at_1`` (the share of
  nonzero values that become 0 when cast to the format unscaled), ``..._at_scale_in_force``
  (at the loss scale the run's scaler held that step, from the trace),
  ``..._at_recommended_scale``, ``max_abs`` (largest finite |x|), ``zero_fraction``; and
  ``fp16probe/overflow_ceiling`` (the largest unscaled |g| anywhere in backward, where the
  report has it; not logged on a step that held inf/NaN), ``fp16probe/loss_scale`` (the scaler's scale), ``fp16probe/skipped_steps`` (steps so far
  whose gradients held inf/NaN: a loss scaler skips them), ``fp16probe/recommended_log2_scale``.
* the skip ledger (the report's ``skips`` section, :mod:`fp16probe.capture.skips`): at each skipped
  step, the scalar ``fp16probe/skipped_step/scale`` (the scale in force) and the text
  ``fp16probe/skipped_step`` (the step, the scale, the module whose gradient held inf/NaN first).
  MLflow keeps each text as the artifact ``fp16probe/skipped_step/step-<step>.txt``.

A folder given to the MLflow export becomes an MLflow SQLite store: ``<folder>/mlflow.db`` (runs,
metrics, texts) and ``<folder>/artifacts``, which MLflow 3 reads as it is
(``MlflowClient(tracking_uri="sqlite:///<folder>/mlflow.db")``, ``mlflow ui --backend-store-uri``
the same), where its file store (``./mlruns``) needs ``MLFLOW_ALLOW_FILE_STORE=true``. A folder
that already holds a file store, or a ``file:`` URI, is written as a file store (the variable set
for the export only); so is any folder under MLflow 2 without SQLAlchemy, which MLflow 2 reads.

Every number comes from the report; the flushed fractions are exact sums of whole bins
(see :class:`fp16probe.histogram.Histogram`). A step whose scale is not a power of two
gets no ``..._at_scale_in_force`` value: there the bins cannot give it exactly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from fp16probe.analysis.whatif import flushed_fraction, fraction
from fp16probe.errors import Fp16ProbeError, InputError, require
from fp16probe.formats import Format, get_format
from fp16probe.histogram import MIN_EXP, Histogram
from fp16probe.presentation import escape
from fp16probe.presentation.answer import recommendation_for, skipped_step_words
from fp16probe.recommendation import Recommendation
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD, KINDS, Report

__all__ = [
    "AXES",
    "TRACKERS",
    "LogHistogram",
    "TrackerLog",
    "TrackerSeries",
    "active_mlflow_run",
    "active_wandb_run",
    "export",
    "log_histogram",
    "sink_for",
    "tensorboard_writer",
    "tracker_series",
]

TRACKERS = ("tensorboard", "wandb", "mlflow")
AXES = ("log2", "magnitude")
PREFIX = "fp16probe"


# -- the data every tracker gets ---------------------------------------------------------------

@dataclass(frozen=True)
class LogHistogram:
    """One histogram as a tracker draws it: ``counts[i]`` values in ``(edges[i], edges[i + 1]]``.

    On the ``log2`` axis the edges are the integers ``e - 1, e``; on the ``magnitude`` axis
    they are ``2^(e-1), 2^e`` themselves. Both are exact in a double.
    """

    edges: tuple[float, ...]
    counts: tuple[int, ...]
    zero: int
    nonfinite: int
    max_abs: float

    @property
    def num(self) -> int:
        """Nonzero finite values in the buckets."""
        return sum(self.counts)

    @property
    def bucket_limits(self) -> tuple[float, ...]:
        """Upper edge of each bucket (TensorBoard's ``bucket_limit``)."""
        return self.edges[1:]

    def moments(self) -> tuple[float, float]:
        """Sum and sum of squares over bucket upper edges (TensorBoard wants them; it draws neither)."""
        s = sum(c * e for c, e in zip(self.counts, self.bucket_limits))
        s2 = sum(c * e * e for c, e in zip(self.counts, self.bucket_limits))
        return float(s), float(s2)


def log_histogram(h: Histogram, axis: str = "log2") -> LogHistogram | None:
    """Return ``h``'s occupied range as tracker buckets, one per log2 bin; None when it has no nonzero value."""
    if axis not in AXES:
        raise InputError(f"axis {axis!r}: expected one of {', '.join(AXES)}")
    lo, hi = h.lowest_exp, h.highest_exp
    if lo is None or hi is None:
        return None
    exps = range(lo - 1, hi + 1)
    edges = tuple(float(e) if axis == "log2" else math.ldexp(1.0, e) for e in exps)
    counts = tuple(h.counts[e - MIN_EXP] for e in range(lo, hi + 1))
    return LogHistogram(edges=edges, counts=counts, zero=h.zero, nonfinite=h.nonfinite, max_abs=h.max_abs)


@dataclass(frozen=True)
class TrackerSeries:
    """Everything one export logs: ``(tag, step, LogHistogram)`` and ``(tag, step, value)`` rows, and texts."""

    histograms: tuple[tuple[str, int, LogHistogram], ...]
    scalars: tuple[tuple[str, int, float], ...]
    texts: tuple[tuple[str, str], ...]
    last_step: int
    step_texts: tuple[tuple[str, int, str], ...] = ()  # (tag, step, text): the skip ledger's entries

    def steps(self) -> tuple[int, ...]:
        """The steps that carry a scalar, histogram or step text, in order."""
        return tuple(sorted({s for _, s, _ in self.scalars} | {s for _, s, _ in self.histograms}
                            | {s for _, s, _ in self.step_texts}))


def _exact_log2(x: float | None) -> int | None:
    if x is None or not x > 0 or not math.isfinite(x):
        return None
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else None


def tracker_series(
    report: Report,
    format: str | Format = "fp16",
    *,
    kind: str = ACTIVATION_GRAD,
    recommendation: Recommendation | None = None,
    modules: bool = False,
    axis: str = "log2",
    step_offset: int = 0,
    since_step: int | None = None,
) -> TrackerSeries:
    """Compute what an exporter logs for ``report``, with no tracker involved.

    ``step_offset`` is added to the report's step numbers (the callbacks pass the number
    that makes them the trainer's global step); ``since_step`` drops the trace steps at or
    before it (live logging sends each step once). The recommendation is the one given,
    the report's own for ``format``, or a fresh analysis (none when the report has no
    ``kind`` values yet).
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    return _series(report, fmt, _recommendation(report, recommendation, fmt, kind), modules=modules,
                   axis=axis, step_offset=step_offset, since_step=since_step)


def _series(report: Report, fmt: Format, rec: Recommendation | None, *, modules: bool = False,
            axis: str = "log2", step_offset: int = 0, since_step: int | None = None,
            skipped_before: int = 0) -> TrackerSeries:
    """What :func:`tracker_series` computes, for a recommendation already chosen (None: no scale).

    ``skipped_before``: skipped steps before the report's trace starts (a windowed report).
    """
    trace = report.trace
    rec_k = None if rec is None else rec.log2_scale
    scaled = bool(report.metadata.grad_scaler) or any(s is not None for s in trace.scale)
    histograms: list[tuple[str, int, LogHistogram]] = []
    scalars: list[tuple[str, int, float]] = []
    skipped = skipped_before
    last_step = step_offset
    forward_steps = list(report.forward.step_max) if report.forward is not None else []
    for i, raw_step in enumerate(trace.steps):
        step = int(raw_step) + step_offset
        last_step = max(last_step, step)
        if i < len(trace.found_inf) and trace.found_inf[i]:
            skipped += 1
        if since_step is not None and step <= since_step:
            continue
        scale = trace.scale[i] if i < len(trace.scale) else None
        k_in_force = 0 if scale is None else _exact_log2(scale)
        for k in KINDS:
            hs = trace.histograms.get(k)
            if hs and i < len(hs) and hs[i].total != 0:
                _kind_points(k, hs[i], step, fmt, axis, k_in_force, rec_k, histograms, scalars)
        scalars.extend(_step_scalars(report, i, step, forward_steps, scale, skipped if scaled else None, rec_k))
    if modules:
        for m in report.modules:
            lh = log_histogram(m.histogram, axis)
            if lh is not None:
                histograms.append((f"{PREFIX}/{m.kind}/{escape.text(m.name)}", last_step, lh))
    step_texts = _skip_points(report, step_offset, since_step, scalars)
    # a skipped step the trace did not sample is a step sent too (a live log does not send it again)
    last_step = max([last_step, *(s for _, s, _ in step_texts)])
    return TrackerSeries(tuple(histograms), tuple(scalars), _recommendation_texts(rec), last_step, step_texts)


def _skip_points(report: Report, step_offset: int, since_step: int | None,
                 scalars: list[tuple[str, int, float]]) -> tuple[tuple[str, int, str], ...]:
    """The skip ledger's entries after ``since_step``: ``skipped_step/scale`` scalars (appended to
    ``scalars``) and one ``skipped_step`` text each (the step, the scale, where the inf/NaN began)."""
    ledger = report.section("skips")
    if ledger is None:
        return ()
    texts = []
    for entry in ledger.steps:
        step = int(entry.step) + step_offset
        if since_step is not None and step <= since_step:
            continue
        if entry.scale is not None:
            scalars.append((f"{PREFIX}/skipped_step/scale", step, float(entry.scale)))
        texts.append((f"{PREFIX}/skipped_step", step, skipped_step_words(entry)))
    return tuple(texts)


def _kind_points(k: str, h: Histogram, step: int, fmt: Format, axis: str, k_in_force: int | None,
                 rec_k: int | None, histograms: list[tuple[str, int, LogHistogram]],
                 scalars: list[tuple[str, int, float]]) -> None:
    """One kind's histogram and scalars at one step, appended in the order they are logged."""
    tag = f"{PREFIX}/{k}"
    lh = log_histogram(h, axis)
    if lh is not None:
        histograms.append((tag, step, lh))
    scalars.append((f"{tag}/flushed_fraction_at_1", step, flushed_fraction(h, fmt, 0)))
    scalars.append((f"{tag}/max_abs", step, float(h.max_abs)))
    scalars.append((f"{tag}/zero_fraction", step, fraction(h.zero, h.total)))
    scalars.append((f"{tag}/nonfinite", step, float(h.nonfinite)))
    if k == ACTIVATION:  # forward values are not multiplied by the loss scale
        return
    if k_in_force is not None:
        scalars.append((f"{tag}/flushed_fraction_at_scale_in_force", step, flushed_fraction(h, fmt, k_in_force)))
    if rec_k is not None:
        scalars.append((f"{tag}/flushed_fraction_at_recommended_scale", step, flushed_fraction(h, fmt, int(rec_k))))


def _step_scalars(report: Report, i: int, step: int, forward_steps: list[Any], scale: float | None,
                  skipped: int | None, rec_k: int | None) -> list[tuple[str, int, float]]:
    """The step's own scalars: the overflow ceiling, the forward maximum, the scale, skipped steps
    (None: the run is not scaled), the recommended scale."""
    out: list[tuple[str, int, float]] = []
    ceiling = report.trace.ceiling
    if ceiling is not None and i < len(ceiling) and math.isfinite(ceiling[i]):
        out.append((f"{PREFIX}/overflow_ceiling", step, float(ceiling[i])))
    if i < len(forward_steps):  # the forward pass's largest |x| and its headroom below fp16's max
        v = forward_steps[i]
        v = math.inf if isinstance(v, str) else float(v)
        out.append((f"{PREFIX}/forward/max_abs", step, v))
        if 0 < v < math.inf:
            out.append((f"{PREFIX}/forward/headroom_bits", step, math.log2(65504.0 / v)))
    if scale is not None:
        out.append((f"{PREFIX}/loss_scale", step, float(scale)))
    if skipped is not None:
        out.append((f"{PREFIX}/skipped_steps", step, float(skipped)))
    if rec_k is not None:
        out.append((f"{PREFIX}/recommended_log2_scale", step, float(rec_k)))
    return out


def _recommendation_texts(rec: Recommendation | None) -> tuple[tuple[str, str], ...]:
    """The recommendation's text and caveats as one logged text (none without a recommendation)."""
    if rec is None:
        return ()
    body = rec.text.rstrip()
    if rec.caveats:
        body += "\n\n" + "\n".join(f"caveat: {c}" for c in rec.caveats)
    if not body.strip():
        return ()
    # The stored text and caveats are report data: each line escaped, the line breaks kept.
    return ((f"{PREFIX}/recommendation", "\n".join(escape.text(line) for line in body.strip().split("\n"))),)


# -- sinks: one per tracker ---------------------------------------------------------------------

class _TensorBoardSink:
    """Write to a ``SummaryWriter`` (torch.utils.tensorboard or tensorboardX)."""

    name = "tensorboard"

    def __init__(self, writer: Any, *, owned: bool = False) -> None:
        self.writer = writer
        self.owned = owned
        self.location = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)

    def write(self, series: TrackerSeries) -> None:
        for tag, step, lh in series.histograms:
            s, s2 = lh.moments()
            self.writer.add_histogram_raw(
                tag, min=lh.edges[0], max=lh.edges[-1], num=lh.num, sum=s, sum_squares=s2,
                bucket_limits=list(lh.bucket_limits), bucket_counts=list(lh.counts), global_step=step,
            )
        for tag, step, value in series.scalars:
            self.writer.add_scalar(tag, value, global_step=step)
        for tag, text in series.texts:
            # TensorBoard renders Markdown: indent by 4 so the text shows as written.
            self.writer.add_text(tag, "\n".join("    " + line for line in text.splitlines()),
                                 global_step=series.last_step)
        for tag, step, text in series.step_texts:
            self.writer.add_text(tag, "    " + text, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.owned:
            self.writer.close()
        else:
            self.writer.flush()


class _WandbSink:
    """Write to a wandb Run: ``wandb.Histogram(np_histogram=(counts, edges))`` and plain scalars.

    Every row carries ``fp16probe/step`` and the ``fp16probe/*`` keys are defined against it,
    so rows land at the profiled step whatever wandb's own step counter says.
    """

    name = "wandb"

    def __init__(self, run: Any, *, owned: bool = False) -> None:
        self.wandb = require("wandb", "wandb", "exporting to Weights & Biases")
        self.run = run
        self.owned = owned
        self.location = getattr(run, "dir", None)
        self._defined = False

    def write(self, series: TrackerSeries) -> None:
        import numpy as np

        if not self._defined:
            self.run.define_metric(f"{PREFIX}/step")
            self.run.define_metric(f"{PREFIX}/*", step_metric=f"{PREFIX}/step")
            self._defined = True
        rows: dict[int, dict[str, Any]] = {}
        for tag, step, lh in series.histograms:
            rows.setdefault(step, {})[tag] = self.wandb.Histogram(
                np_histogram=(np.asarray(lh.counts, dtype=np.int64), np.asarray(lh.edges, dtype=np.float64))
            )
        for tag, step, value in series.scalars:
            rows.setdefault(step, {})[tag] = value
        for tag, step, text in series.step_texts:
            rows.setdefault(step, {})[tag] = text
        for step in sorted(rows):
            self.run.log({**rows[step], f"{PREFIX}/step": step})
        for tag, text in series.texts:
            self.run.summary[tag] = text

    def close(self) -> None:
        if self.owned:
            self.run.finish()


class _MlflowSink:
    """Write metrics to an MLflow run; :meth:`artifacts` adds the figures and an HTML report."""

    name = "mlflow"

    def __init__(self, client: Any, run_id: str, *, owned: bool = False) -> None:
        self.client = client
        self.run_id = run_id
        self.owned = owned
        self.location = run_id

    def write(self, series: TrackerSeries) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key=_mlflow_key(tag), value=float(v), timestamp=now, step=int(step))
                   for tag, step, v in series.scalars]
        for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])
        for tag, text in series.texts:
            self.client.log_text(self.run_id, text + "\n", f"{_mlflow_key(tag)}.txt")
        for tag, step, text in series.step_texts:  # one file a skipped step: a later log adds, never replaces
            self.client.log_text(self.run_id, text + "\n", f"{_mlflow_key(tag)}/step-{step}.txt")

    def artifacts(self, report: Report, fmt: Format, kind: str, recommendation: Recommendation | None) -> None:
        """Upload the report JSON, its figures (PNG) and a standalone HTML report."""
        from fp16probe.presentation.html import report_html

        with tempfile.TemporaryDirectory(prefix="fp16probe-mlflow-") as tmp:
            folder = Path(tmp)
            report.save(folder / "fp16probe-report.json")
            if report.modules_of(kind) and importlib.util.find_spec("matplotlib") is not None:
                from fp16probe.presentation.figures import save_figures

                save_figures(report, folder / "fp16probe-figures.png", recommendation=recommendation,
                             format=fmt, kind=kind)
            page = report_html(report, fmt, kind=kind, recommendation=recommendation)
            (folder / "fp16probe-report.html").write_text(
                "<!doctype html>\n<html><head><meta charset='utf-8'><title>fp16probe report: "
                f"{escape.xml(report.metadata.model_class)}</title></head><body>{page}</body></html>\n",
                encoding="utf-8",
            )
            self.client.log_artifacts(self.run_id, str(folder), artifact_path="fp16probe")

    def close(self) -> None:
        if self.owned:
            self.client.set_terminated(self.run_id)


def _mlflow_key(tag: str) -> str:
    # MLflow keys allow letters, digits, _ - . space / ; module names may hold others.
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in tag)


def sink_for(target: Any) -> Any:
    """Return the sink that writes to ``target``: a SummaryWriter, a wandb Run, an ``(MlflowClient, run_id)``
    pair, the ``mlflow`` module with an active run, or a Lightning logger wrapping one of these."""
    if target is None:
        raise InputError("no tracker given: pass a SummaryWriter, a wandb run or an MLflow client and run id")
    if hasattr(target, "add_histogram_raw"):
        return _TensorBoardSink(target)
    if isinstance(target, tuple) and len(target) == 2 and hasattr(target[0], "log_batch"):
        return _MlflowSink(target[0], str(target[1]))
    if getattr(target, "__name__", None) == "mlflow":
        run = target.active_run()
        if run is None:
            raise InputError("mlflow has no active run: call mlflow.start_run() first, or pass (client, run_id)")
        return _MlflowSink(target.MlflowClient(), run.info.run_id)
    if hasattr(target, "log") and hasattr(target, "define_metric"):
        return _WandbSink(target)
    experiment = getattr(target, "experiment", None)  # a Lightning logger
    if experiment is not None:
        if hasattr(experiment, "log_batch") and getattr(target, "run_id", None):
            return _MlflowSink(experiment, target.run_id)
        return sink_for(experiment)
    raise InputError(
        f"cannot log to a {type(target).__name__}: expected a tensorboard SummaryWriter, a wandb run, "
        "an (mlflow.MlflowClient, run_id) pair, or a Lightning logger wrapping one of them"
    )


def tensorboard_writer(log_dir: Any) -> Any:
    """Return a new ``torch.utils.tensorboard.SummaryWriter`` in ``log_dir``, marked as made by fp16probe."""
    require("tensorboard", "tensorboard", "logging to TensorBoard")
    writer_mod = require("torch.utils.tensorboard", "tensorboard", "logging to TensorBoard")
    writer = writer_mod.SummaryWriter(log_dir=str(log_dir))
    writer._fp16probe_owned = True
    return writer


def active_wandb_run() -> Any:
    """The wandb run in progress (``wandb.run``), or None."""
    wandb = require("wandb", "wandb", "logging to Weights & Biases")
    return wandb.run


def active_mlflow_run() -> tuple[Any, str] | None:
    """``(MlflowClient, run_id)`` of MLflow's active run, or None."""
    mlflow = require("mlflow", "mlflow", "logging to MLflow")
    run = mlflow.active_run()
    return None if run is None else (mlflow.MlflowClient(), run.info.run_id)


# -- finished reports -----------------------------------------------------------------------------

def export(
    report: Report,
    *,
    to: str,
    dest: Any = None,
    format: str | Format = "fp16",
    kind: str = ACTIVATION_GRAD,
    recommendation: Recommendation | None = None,
    modules: bool = False,
    axis: str = "log2",
    step_offset: int = 0,
    run_name: str | None = None,
    project: str = "fp16probe",
) -> Any:
    """Log a finished report to a tracker; see the module docstring for what is logged.

    Args:
        report: the report (e.g. ``Report.load("fp16probe-report.json")``).
        to: ``"tensorboard"``, ``"wandb"`` or ``"mlflow"``.
        dest: a folder or tracking URI (a new writer or run is made there and closed), or an
            open SummaryWriter / wandb Run / ``(MlflowClient, run_id)`` (left open).
            TensorBoard needs one; wandb defaults to its own folder; MLflow to its default store.
        format, kind: what the flushed fractions and the recommendation are for.
        modules: also log each module's histogram over the whole run.
        axis: ``"log2"`` (bucket edges are the exponents, readable on TensorBoard's linear
            axis) or ``"magnitude"`` (edges ``2^e`` themselves).
        step_offset: added to every step number.
        run_name, project: names for a new wandb or MLflow run (experiment).

    Returns the folder written (TensorBoard, wandb) or the MLflow run id.
    """
    if to not in TRACKERS:
        raise InputError(f"--to {to!r}: expected one of {', '.join(TRACKERS)}")
    fmt = format if isinstance(format, Format) else get_format(format)
    rec = _recommendation(report, recommendation, fmt, kind)
    series = _series(report, fmt, rec, modules=modules, axis=axis, step_offset=step_offset)
    with _file_store_allowed(to, dest):
        sink = _open(to, dest, run_name=run_name, project=project)
        try:
            sink.write(series)
            if isinstance(sink, _MlflowSink):
                sink.artifacts(report, fmt, kind, rec)
                location = sink.run_id
            else:
                location = Path(sink.location) if sink.location else None
        finally:
            sink.close()
    return location


@contextlib.contextmanager
def _file_store_allowed(to: str, dest: Any) -> Iterator[None]:
    """Let MLflow 3 use its file store while exporting to a folder the caller named.

    MLflow 3 refuses a plain folder unless ``MLFLOW_ALLOW_FILE_STORE`` is set; naming a
    folder is that choice, so it is set for the export only and restored afterwards.
    """
    local = to == "mlflow" and isinstance(dest, (str, os.PathLike)) and _mlflow_uri(dest).startswith("file:")
    if not local or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


def _open(to: str, dest: Any, *, run_name: str | None, project: str) -> Any:
    """Open the sink a finished-report export writes to; a path or URI makes a new writer or run."""
    if dest is not None and not isinstance(dest, (str, os.PathLike)):
        sink = sink_for(dest)
        if sink.name != to:
            raise InputError(f"to={to!r} but the destination given is a {sink.name} object")
        return sink
    if to == "tensorboard":
        if dest is None:
            raise InputError("exporting to TensorBoard needs a log folder, e.g. runs/fp16probe")
        return _TensorBoardSink(tensorboard_writer(dest), owned=True)
    if to == "wandb":
        wandb = require("wandb", "wandb", "exporting to Weights & Biases")
        if dest is not None:
            Path(dest).mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(project=project, name=run_name, dir=None if dest is None else str(dest),
                             reinit="create_new")
        except Exception as e:  # no API key, no network: wandb raises its own types
            raise InputError(
                f"wandb could not start a run ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                "log in with 'wandb login', or set WANDB_MODE=offline to write locally and 'wandb sync' later"
            ) from e
        return _WandbSink(run, owned=True)
    mlflow = require("mlflow", "mlflow", "exporting to MLflow")
    uri = None if dest is None else _mlflow_uri(dest)
    artifacts = None
    if uri is not None and uri.startswith("sqlite:") and uri != os.fspath(dest):
        # a folder: its own artifact root beside the database (MLflow's default is ./mlartifacts of the cwd)
        Path(dest).mkdir(parents=True, exist_ok=True)
        artifacts = (Path(dest).absolute() / MLFLOW_ARTIFACTS).as_uri()
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(project)
    experiment_id = (experiment.experiment_id if experiment is not None
                     else client.create_experiment(project, artifact_location=artifacts))
    run = client.create_run(experiment_id, run_name=run_name)
    return _MlflowSink(client, run.info.run_id, owned=True)


MLFLOW_DB = "mlflow.db"  # the SQLite store an export to a folder makes (what MLflow 3 reads by default)
MLFLOW_ARTIFACTS = "artifacts"  # its artifact root, beside it


def _mlflow_uri(dest: Any) -> str:
    """The tracking URI for ``dest``: a URI as given; a folder's SQLite store, or its file store where
    the folder already holds one (or MLflow 2 has no SQLAlchemy to write SQLite with)."""
    text = os.fspath(dest)
    if "://" in text or text.startswith(("file:", "databricks", "sqlite:")):
        return text
    folder = Path(text).absolute()
    if _is_file_store(folder) or not _sqlite_writable():
        return folder.as_uri()
    return "sqlite:///" + (folder / MLFLOW_DB).as_posix()


def _is_file_store(folder: Path) -> bool:
    """Whether ``folder`` already holds an MLflow file store (its trash folder, or an experiment's meta.yaml)."""
    if (folder / ".trash").is_dir():
        return True
    return folder.is_dir() and any((c / "meta.yaml").is_file() for c in folder.iterdir() if c.is_dir())


def _sqlite_writable() -> bool:
    """Whether MLflow can write a SQLite store here; raise when MLflow 3 cannot (its file store needs an opt-in)."""
    if all(importlib.util.find_spec(name) is not None for name in ("sqlalchemy", "alembic")):
        return True
    from importlib.metadata import PackageNotFoundError, version

    found = ""
    for dist in ("mlflow", "mlflow-skinny"):
        with contextlib.suppress(PackageNotFoundError):
            found = found or version(dist)
    if found and int(found.split(".")[0]) < 3:
        return False  # MLflow 2 reads its file store without any opt-in
    raise InputError(
        f"exporting to an MLflow folder writes a SQLite store there (MLflow {found or '3'} reads a plain folder "
        "only with MLFLOW_ALLOW_FILE_STORE=true), which needs SQLAlchemy and alembic: "
        "pip install 'fp16probe[mlflow]'; or pass a tracking URI")


# -- live logging --------------------------------------------------------------------------------

class TrackerLog:
    """Log reports of a run in progress to a tracker, each profiled step once.

    Feed it the report so far (``probe.report()``) at each logging interval; steps already
    sent are skipped, module histograms (``modules=True``) are the running totals.
    """

    def __init__(self, target: Any, *, format: str | Format = "fp16", kind: str = ACTIVATION_GRAD,
                 modules: bool = False, axis: str = "log2", step_offset: int = 0,
                 recommend: bool = True) -> None:
        self.sink = target if hasattr(target, "write") and hasattr(target, "close") else sink_for(target)
        self.format = get_format(format)
        self.kind = kind
        self.modules = modules
        self.axis = axis
        self.step_offset = step_offset
        self.recommend = recommend
        self.last_step: int | None = None
        self._skipped = 0  # skipped steps sent so far (windowed reports)

    def log(self, report: Report, recommendation: Recommendation | None = None) -> int:
        """Send the steps of ``report`` not sent yet; return how many steps were sent."""
        rec = _recommendation(report, recommendation, self.format, self.kind) if self.recommend else recommendation
        # A windowed report (Probe.report(since_step=...)) starts where the last one ended: carry
        # the skipped-step count over, less the steps it sends again.
        windowed = report.capture is not None and report.capture.trace_since_step is not None
        prev = self.last_step
        trace = report.trace
        again = sum(1 for st, f in zip(trace.steps, trace.found_inf)
                    if f and prev is not None and st + self.step_offset <= prev)
        before = self._skipped - again if windowed else 0
        series = _series(report, self.format, rec, modules=self.modules, axis=self.axis,
                         step_offset=self.step_offset, since_step=self.last_step, skipped_before=before)
        if not series.steps() or (self.last_step is not None and max(series.steps()) <= self.last_step):
            return 0  # no new step: module totals alone are not logged again
        self.sink.write(series)
        sent = len(series.steps())
        self.last_step = series.last_step
        self._skipped = before + sum(1 for f in trace.found_inf if f)
        return sent

    def finish(self, report: Report) -> None:
        """Attach the final report's files where the tracker keeps files (MLflow: JSON, figures, HTML)."""
        if isinstance(self.sink, _MlflowSink):
            rec = _recommendation(report, None, self.format, self.kind)
            self.sink.artifacts(report, self.format, self.kind, rec)

    def close(self) -> None:
        """Flush the tracker (a writer or run the caller passed in stays open)."""
        self.sink.close()


def _recommendation(report: Report, given: Recommendation | None, fmt: Format, kind: str) -> Recommendation | None:
    """The recommendation given, the report's own for ``fmt``, or a fresh analysis (None when none can be made)."""
    if given is not None:
        return given
    stored = recommendation_for(report, fmt.name)
    if stored is not None or not report.modules_of(kind):
        return stored
    from fp16probe.analysis.recommend import analyze

    try:
        return analyze(report, fmt, kind=kind)
    except Fp16ProbeError:  # e.g. no values of that kind yet
        return None
