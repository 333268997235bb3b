"""What a long run's report costs to read: file size, peak memory and CPU time of show, schedule and compare.

A report of a 12-layer GPT-2 (125 hooked modules, 148 parameters, the names GPT2LMHeadModel's
Probe report has) sampled on every step, as the Hugging Face and Lightning callbacks record by
default (``every=1``): per step an activation- and a weight-gradient histogram, each module's and
parameter's largest |g|, the scale, found_inf and the overflow ceiling in the trace; the scale,
largest gradient, ceiling and forward maximum in the history. The numbers are synthetic (a
seeded generator, no training): a report's cost to read depends on its shape, not on what the
numbers mean. Built directly as arrays and written in either form:

* ``--form rows``: a list per step (the form every report had before the packed one);
* ``--form packed``: the packed columns (``fp16probe.columns``), what ``Report.save`` writes for
  a trace of more than ``PACK_FROM`` steps.

Each command runs in a fresh process (``python -m fp16probe show/schedule/compare``) under
``/usr/bin/time -v`` where there is one (else ``resource.getrusage`` of the child): peak resident
set size and user+system CPU time.

    python bench/long_history.py --steps 10000 100000 1000000            # the table in docs/faults.md
    python bench/long_history.py --steps 10000 --form rows --form packed # the two forms side by side
    python bench/long_history.py --steps 1000 --keep /tmp/reports        # keep the files written

The read cap is raised (``FP16PROBE_MAX_REPORT_MB``, to just above the file) so that every size is measured;
the table says which files the default cap refuses.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("PYTHONPATH") and ROOT not in sys.path:  # this checkout unless PYTHONPATH names one
    sys.path.insert(0, ROOT)

LAYERS = 12
BINS_PER_HISTOGRAM = 44  # occupied exponent bins of one step's histogram (a real GPT-2 step: 40 to 50)


def gpt2_names(layers: int = LAYERS) -> tuple[list[str], list[str]]:
    """The hooked modules and the parameters of a Probe report of GPT2LMHeadModel (tied lm_head)."""
    modules = ["transformer.wte", "transformer.wpe", "transformer.drop"]
    params = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(layers):
        h = f"transformer.h.{i}"
        modules += [f"{h}.{m}" for m in ("ln_1", "attn.c_attn", "attn.c_proj", "attn.attn_dropout",
                                         "attn.resid_dropout", "ln_2", "mlp.c_fc", "mlp.c_proj", "mlp.act",
                                         "mlp.dropout")]
        params += [f"{h}.{m}.{w}" for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
                   for w in ("weight", "bias")]
    modules += ["transformer.ln_f", "lm_head"]
    params += ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    return modules, params


def synthetic_columns(steps: int, seed: int = 0) -> dict[str, Any]:
    """Every per-step field of the report, as arrays (see the module docstring)."""
    from fp16probe.histogram import MIN_EXP

    rng = np.random.default_rng(seed)
    modules, params = gpt2_names()
    out: dict[str, Any] = {"steps": np.arange(steps, dtype=np.int64), "names": {}, "hist": {}, "module_max": {}}
    for kind, names, centre, total in (("activation_grad", modules, -30, 3 * 2**20), ("weight_grad", params, -24, 2**27)):
        out["names"][kind] = names
        lo = (centre - BINS_PER_HISTOGRAM // 2 + rng.integers(-2, 3, steps)).astype(np.int64)
        x = np.arange(BINS_PER_HISTOGRAM) - BINS_PER_HISTOGRAM / 2
        shape = np.exp(-x**2 / 60.0)
        shape = shape / shape.sum()
        jitter = rng.uniform(0.9, 1.1, (steps, BINS_PER_HISTOGRAM))
        counts = np.maximum((total * shape * jitter).astype(np.int64), 1)
        top = lo + BINS_PER_HISTOGRAM - 1
        # inside (2^(top-1), 2^top] after rounding to float32
        max_abs = np.ldexp(rng.uniform(0.501, 1.0, steps), top).astype(np.float32).astype(np.float64)
        out["hist"][kind] = {"lo": lo - MIN_EXP, "counts": counts, "zero": rng.integers(0, 1000, steps),
                             "max_abs": max_abs}
        maxima = np.ldexp(rng.uniform(0.5, 1.0, (len(names), steps)), rng.integers(-20, -2, (len(names), steps)))
        out["module_max"][kind] = maxima.astype(np.float32).astype(np.float64)
    ceiling = np.maximum(out["hist"]["activation_grad"]["max_abs"], out["hist"]["weight_grad"]["max_abs"])
    found = rng.random(steps) < 0.001
    scale = np.full(steps, 65536.0)
    ceiling[found] = np.inf
    out.update(scale=scale, found_inf=found, ceiling=ceiling,
               grad_max=np.where(found, np.inf, out["hist"]["weight_grad"]["max_abs"]),
               forward_max=np.ldexp(rng.uniform(0.5, 1.0, steps), 6).astype(np.float32).astype(np.float64))
    return out


def _module_records(cols: dict[str, Any]) -> list[dict[str, Any]]:
    """Each module's histogram: the trace's counts shared out, so that they add up to the trace exactly."""
    from fp16probe.histogram import MIN_EXP, NUM_EXP_BINS

    records = []
    for kind, names in cols["names"].items():
        h = cols["hist"][kind]
        dense = np.zeros(NUM_EXP_BINS, dtype=np.int64)
        for b in range(BINS_PER_HISTOGRAM):
            np.add.at(dense, h["lo"] + b, h["counts"][:, b])
        zero = int(h["zero"].sum())
        share = dense // len(names)
        for j, name in enumerate(names):
            counts = share + (dense - share * len(names) if j == 0 else 0)
            occupied = np.flatnonzero(counts)
            top = (float(h["max_abs"].max()) if j == 0
                   else float(np.ldexp(1.0, int(occupied[-1]) + MIN_EXP)) if len(occupied) else 0.0)
            bins = {str(int(e) + MIN_EXP): int(counts[e]) for e in occupied}
            records.append({"name": name, "kind": kind, "module_type": "Parameter" if kind == "weight_grad" else "Linear",
                            "order": len(records), "histogram": {"bins": bins, "zero": zero if j == 0 else 0,
                                                                 "inf": 0, "nan": 0, "max_abs": top}})
    return records


def _head(cols: dict[str, Any]) -> dict[str, Any]:
    modules, _ = gpt2_names()
    n = len(cols["steps"])
    return {"schema_version": 1,
            "metadata": {"fp16probe_version": "0.1.0", "torch_version": "2.13.0+cpu", "device": "cpu",
                         "model_class": "GPT2LMHeadModel", "precision": "fp16", "param_dtype": "torch.float32",
                         "steps_seen": n, "steps_total": n, "every": 1,
                         "captured": ["activation_grad", "weight_grad"], "hooked_modules": modules,
                         "grad_scaler": True, "world_size": 1, "partial": False, "created": "", "extra": {}},
            "modules": _module_records(cols), "recommendation": None}


def write_rows(cols: dict[str, Any], f: TextIO) -> None:
    """Write the report with its trace and history as lists per step, streamed (never whole in memory)."""
    from fp16probe.histogram import MIN_EXP

    head = json.dumps(_head(cols))
    f.write(head[:-1])
    n = len(cols["steps"])

    def floats(a: np.ndarray) -> str:
        return json.dumps([("inf" if v == np.inf else v) for v in a.tolist()])

    f.write(', "trace": {"steps": ' + json.dumps(cols["steps"].tolist()) + ', "histograms": {')
    for j, (kind, h) in enumerate(cols["hist"].items()):
        f.write(("" if j == 0 else ", ") + json.dumps(kind) + ": [")
        for i in range(n):
            lo = int(h["lo"][i]) + MIN_EXP
            bins = {str(lo + b): int(c) for b, c in enumerate(h["counts"][i].tolist())}
            f.write(("" if i == 0 else ", ") + json.dumps({"bins": bins, "zero": int(h["zero"][i]), "inf": 0, "nan": 0,
                                                          "max_abs": float(h["max_abs"][i])}))
        f.write("]")
    f.write('}, "module_max": {')
    for j, (kind, names) in enumerate(cols["names"].items()):
        f.write(("" if j == 0 else ", ") + json.dumps(kind) + ": {")
        for k, name in enumerate(names):
            f.write(("" if k == 0 else ", ") + json.dumps(name) + ": " + json.dumps(cols["module_max"][kind][k].tolist()))
        f.write("}")
    f.write('}, "scale": ' + json.dumps(cols["scale"].tolist()) + ', "found_inf": '
            + json.dumps(cols["found_inf"].tolist()) + ', "ceiling": ' + floats(cols["ceiling"]) + "}")
    f.write(', "history": {"first_step": 0, "scale": ' + json.dumps(cols["scale"].tolist())
            + ', "grad_max": ' + floats(cols["grad_max"]) + ', "ceiling": ' + floats(cols["ceiling"])
            + ', "forward_max": ' + floats(cols["forward_max"]) + "}}")


def write_packed(cols: dict[str, Any], f: TextIO) -> None:
    """Write the report with its trace and history in the packed columns (what Report.save writes for a long trace)."""
    from fp16probe import columns

    d = _head(cols)
    d["trace"] = columns.pack_trace(steps=cols["steps"], histograms=cols["hist"], names=cols["names"],
                                    module_max=cols["module_max"], scale=cols["scale"], found_inf=cols["found_inf"],
                                    ceiling=cols["ceiling"])
    d["history"] = columns.pack_history(0, cols["scale"], cols["grad_max"], cols["ceiling"], cols["forward_max"])
    f.write(json.dumps(d, allow_nan=False))


WRITERS = {"rows": write_rows, "packed": write_packed}
COMMANDS = {"show": ["show", "{a}"], "schedule": ["schedule", "{a}"], "compare": ["compare", "{a}", "{a}"]}


def measure(argv: list[str], size: int) -> tuple[float, float]:
    """Run ``python -m fp16probe *argv`` in a fresh process: (peak RSS in MiB, user+system CPU seconds).

    The read cap is raised to just above ``size`` bytes when the file is over the default."""
    cap = max(256, size // 2**20 + 1)
    env = {**os.environ, "FP16PROBE_MAX_REPORT_MB": str(cap), "PYTHONPATH": os.environ.get("PYTHONPATH") or ROOT}
    cmd = [sys.executable, "-m", "fp16probe", *argv]
    timer = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    if timer:
        done = subprocess.run([timer, "-v", *cmd], env=env, capture_output=True, text=True)
        fields = dict(line.strip().rsplit(": ", 1) for line in done.stderr.splitlines()
                      if line.startswith("\t") and ": " in line)
        rss = int(fields["Maximum resident set size (kbytes)"]) / 1024
        cpu = float(fields["User time (seconds)"]) + float(fields["System time (seconds)"])
    else:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        rss = after.ru_maxrss / 1024
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode not in (0, 1):  # compare exits 1 on a regression; anything else is a failure
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}: {' | '.join(tail)}")
    return rss, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--form", action="append", choices=sorted(WRITERS), help="default: packed")
    parser.add_argument("--command", action="append", choices=sorted(COMMANDS), help="default: all three")
    parser.add_argument("--keep", type=Path, help="write the reports here and keep them")
    args = parser.parse_args()
    from fp16probe.reading import DEFAULT_MAX_REPORT_MB

    folder = args.keep or Path(tempfile.mkdtemp(prefix="fp16probe-long-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"load {os.getloadavg()[0]:.2f}; peak RSS of the process, user+system CPU time; "
          f"default cap {DEFAULT_MAX_REPORT_MB} MiB")
    print(f"{'steps':>9} {'form':>6} {'MB':>9} {'B/step':>7} {'cap':>7}  " + "  ".join(
        f"{c + ' MiB':>13} {c + ' s':>11}" for c in (args.command or COMMANDS)))
    try:
        for steps in args.steps:
            cols = synthetic_columns(steps)
            for form in args.form or ["packed"]:
                path = folder / f"long-{steps}-{form}.json"
                with open(path, "w", encoding="utf-8") as f:
                    WRITERS[form](cols, f)
                size = path.stat().st_size
                fits = "reads" if size <= DEFAULT_MAX_REPORT_MB * 2**20 else "over"
                cells = []
                for c in args.command or COMMANDS:
                    rss, cpu = measure([a.format(a=path) for a in COMMANDS[c]], size)
                    cells.append(f"{rss:13,.0f} {cpu:11.1f}")
                print(f"{steps:9,} {form:>6} {size / 1e6:9,.1f} {size / steps:7,.0f} {fits:>7}  " + "  ".join(cells),
                      flush=True)
                if not args.keep:
                    path.unlink()
            del cols
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
