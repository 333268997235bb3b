"""Write docs/interval-study.md's generated tables and figure from the study's JSON, or check that they are current.

    python docs/interval_study_doc.py          # rewrite the tables in place and redraw docs/images/interval-study.png
    python docs/interval_study_doc.py --check  # exit 1 when a table differs from docs/data/interval-study.json

The JSON is what ``bench/interval_study.py --out docs/data/interval-study.json`` writes (or the
families' ``--family NAME --out`` files merged, in the study's order). A generated block sits
between ``<!-- study: NAME -->`` and ``<!-- /study -->``: ``summary`` (one row per family) and
``family-NAME`` (that family's grid), ``across`` (every rule over the families) and ``seeds`` (each
family's finding at seed 0 beside seed 1's, from docs/data/interval-study-seed1.json, ``--seed 1``).
``tests/test_interval_study.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp16probe.analysis.interval_study import choose, meets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "interval-study.md"
DATA = ROOT / "docs" / "data" / "interval-study.json"
SEED1 = ROOT / "docs" / "data" / "interval-study-seed1.json"  # the same families from other weights and data order
FIGURE = ROOT / "docs" / "images" / "interval-study.png"
NEVER = 10**9
BLOCK = re.compile(r"(<!-- study: ([\w-]+) -->\n)(.*?)(<!-- /study -->)", re.S)


def _gi(gi: int) -> str:
    return "never" if gi >= NEVER else str(gi)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def _err(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _row(f: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in f["rows"] if r["rule"] == name)


def summary(study: dict[str, Any]) -> str:
    head = ("| family | params | steps | drift (log2 max\\|g\\| per 1000 steps) | defaults (2000, x2, x0.5): skipped | "
            "best interval (x2, x0.5) | its skipped | steps saved | best rule of the grid (skipped) | "
            "checks: real / own replay / predicted at intervals |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|\n")
    lines = []
    for f in study["families"]:
        d, b, g = f["rows"][0], choose(f["rows"]), choose(f["rows"], defaults_factors=False)
        checks = "; ".join(f"{c['growth_interval']}: {c['real']} / {c['own_replay']} / {c['predicted']}" for c in f["checks"])
        lines.append(f"| {f['family']} | {f['parameters']:,} | {f['steps']} | {f['drift_log2_per_1000']:+.2f} | "
                     f"{d['skipped_steps']} | {_gi(b['growth_interval'])} | {b['skipped_steps']} | "
                     f"{d['skipped_steps'] - b['skipped_steps']} | {g['rule']} ({g['skipped_steps']}) | {checks} |")
    return head + "\n".join(lines) + "\n"


def family(f: dict[str, Any]) -> str:
    head = ("| rule | skipped | mean flushed | steps flushing > 0.1% | gradient error (emulated) | backoffs | growths |\n"
            "|---|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in f["rows"]:
        mark = (" (best interval)" if r is choose(f["rows"]) else
                " (best of the grid)" if r is choose(f["rows"], defaults_factors=False) else "")
        lines.append(f"| {r['rule']}{mark} | {r['skipped_steps']} | {_pct(r['mean_flushed_fraction'])} | "
                     f"{r['steps_below_needed']} | {_err(r['gradient_error'])} | {r['backoffs']} | {r['growths']} |")
    return head + "\n".join(lines) + "\n"


def across(study: dict[str, Any]) -> str:
    """Every rule: in how many families it meets the defaults' flushed share, steps flushing and error, and its skipped steps in each."""
    fams = study["families"]
    head = ("| rule | families where it flushes and errs no more than the defaults | skipped steps, all families | "
            + " | ".join(f["family"] for f in fams) + " |\n|---|---:|---:|" + "---:|" * len(fams) + "\n")
    lines = []
    for i, r0 in enumerate(fams[0]["rows"]):
        rows = [f["rows"][i] for f in fams]
        ok = sum(meets(r, f["rows"][0]) for r, f in zip(rows, fams))
        cells = " | ".join(str(r["skipped_steps"]) + ("" if meets(r, f["rows"][0]) else "*") for r, f in zip(rows, fams))
        lines.append((-ok, sum(r["skipped_steps"] for r in rows), i,
                      f"| {r0['rule']} | {ok} of {len(fams)} | {sum(r['skipped_steps'] for r in rows)} | {cells} |"))
    return head + "\n".join(line for *_, line in sorted(lines)) + "\n"


def _finding(f: dict[str, Any]) -> str:
    d, b = f["rows"][0], choose(f["rows"])
    checks = ", ".join(f"{c['real']}/{c['own_replay']}/{c['predicted']}" for c in f["checks"])
    return (f"{f['drift_log2_per_1000']:+.2f} | {d['skipped_steps']} ({_pct(d['mean_flushed_fraction'])}) | "
            f"{_gi(b['growth_interval'])}: {b['skipped_steps']} ({_pct(b['mean_flushed_fraction'])}) | {checks}")


def seeds(study: dict[str, Any], other: dict[str, Any] | None) -> str:
    """Each family's drift, the defaults' and the best interval's skipped steps (mean flushed), at each seed."""
    head = ("| family | seed | drift | defaults: skipped (mean flushed) | best interval: skipped (mean flushed) | "
            "checks at " + ", ".join(str(c) for c in study["tier_settings"]["checks"]) + ": real/own replay/predicted |\n"
            "|---|---:|---:|---:|---:|---|\n")
    by_name = {f["family"]: f for f in (other or {}).get("families", ())}
    lines = []
    for f in study["families"]:
        lines.append(f"| {f['family']} | {f.get('seed', 0)} | {_finding(f)} |")
        if f["family"] in by_name:
            g = by_name[f["family"]]
            lines.append(f"| {g['family']} | {g.get('seed', 1)} | {_finding(g)} |")
    return head + "\n".join(lines) + "\n"


def blocks(study: dict[str, Any], other: dict[str, Any] | None = None) -> dict[str, str]:
    out = {"summary": summary(study), "across": across(study), "seeds": seeds(study, other)}
    for f in study["families"]:
        out[f"family-{f['family']}"] = family(f)
    return out


def render(page: str, study: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    made = blocks(study, other)

    def sub(m: re.Match[str]) -> str:
        return m.group(1) + made.get(m.group(2), m.group(3)) + m.group(4)

    return BLOCK.sub(sub, page)


def figure(study: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = study["families"]
    fig, axes = plt.subplots(2, (len(fams) + 1) // 2, figsize=(12, 7), squeeze=False)
    for ax, f in zip(axes.flat, fams):
        rows = [r for r in f["rows"] if r["rule"].endswith(" x2 /x2")]
        xs = [100 * (r["mean_flushed_fraction"] or 0.0) for r in rows]
        ys = [r["skipped_steps"] for r in rows]
        ax.plot(xs, ys, "o-", color="tab:blue")
        labels: dict[tuple[float, int], list[str]] = {}
        for x, y, r in zip(xs, ys, rows):  # intervals replaying to the same point share one label
            labels.setdefault((x, y), []).append(_gi(r["growth_interval"]))
        for (x, y), names in labels.items():
            text = names[0] if len(names) == 1 else f"{names[0]}-{names[-1]}"
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.ticklabel_format(axis="x", useOffset=False)
        ax.locator_params(axis="x", nbins=4)
        d = f["rows"][0]
        ax.plot([100 * (d["mean_flushed_fraction"] or 0.0)], [d["skipped_steps"]], "s", color="tab:red",
                label="GradScaler defaults")
        ax.set_title(f"{f['family']} (drift {f['drift_log2_per_1000']:+.2f} bits/1000 steps)", fontsize=9)
        ax.set_xlabel("mean flushed share at the scale in force (%)", fontsize=8)
        ax.set_ylabel("skipped steps", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Growth interval (x2 / x0.5) replayed on each family's fp16 history: skipped steps against flushed share",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    study = json.loads(DATA.read_text(encoding="utf-8"))
    other = json.loads(SEED1.read_text(encoding="utf-8")) if SEED1.exists() else None
    page = PAGE.read_text(encoding="utf-8")
    new = render(page, study, other)
    if args.check:
        stale = [m.group(2) for m in BLOCK.finditer(page) if blocks(study, other).get(m.group(2)) != m.group(3)]
        for name in stale:
            print(f"stale: docs/interval-study.md block {name!r} differs from docs/data/interval-study.json")
        return 1 if stale else 0
    PAGE.write_text(new, encoding="utf-8")
    figure(study, FIGURE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
