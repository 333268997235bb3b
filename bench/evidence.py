"""Evidence on both sides: small models trained for real in fp32 and low precision, beside the tool's verdict.

Run from the repository root (it writes the table of docs/evidence.md)::

    python bench/evidence.py                       # every case, 200 steps x 3 seeds
    python bench/evidence.py --steps 100 --seeds 2 --cases mlp naive_variance

For each case of tests/fixtures/evidence_models.py, in plain torch (no fp16probe arithmetic but the band's
definition, fp16probe.analysis.trial):

- the tool's verdict: ``fp16probe.profile(model, batches, loss, format=..., target="cpu")`` on the first
  batches, and the loss scale it answers;
- per parameter, over the first 4 batches at that scale, as the profile judges them (error_and_noise): the
  low-precision gradient's error against fp32's and one batch's gradient noise, both as shares of the batch
  gradient's RMS norm; the table gives the worst error's parameter, its noise, and the largest error/noise ratio
  over parameters, at the initial weights (where the profile measures) and again at the weights of ``steps``
  fp32 steps (seed 0's order: near the end of training, where a loss floor shows);
- training: Adam from the same weights, ``steps`` steps over the fixed data set in a data order drawn
  from each seed, in fp32 and in the target precision (CPU autocast; fp16 with
  ``torch.amp.GradScaler("cpu")`` at the tool's settings), and whether each low-precision seed's mean
  loss over the last fifth of the steps lies inside fp32's seed band (fp16probe.analysis.trial).

A case whose gradients flush without a scaler (``loss_weight``) also trains in fp16 at S = 1 (no scaling).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp16probe  # noqa: E402
from fp16probe.analysis.trial import Band, judge_curves  # noqa: E402
from tests.fixtures.evidence_models import CASES, Case  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NOISE_BATCHES = 4  # the batches the profile measures noise on (fp16probe.profile: up to 4)


def order(n: int, steps: int, seed: int) -> list[int]:
    """Batch indices for ``steps`` steps: a fresh permutation of the ``n`` batches each epoch, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < steps:
        out += torch.randperm(n, generator=g).tolist()
    return out[:steps]


def train(case: Case, precision: str, seed: int, steps: int, scaler_kwargs: dict[str, Any] | None = None,
          model: torch.nn.Module | None = None) -> tuple[list[float], int]:
    """The loss at each step of ``steps`` Adam steps and the GradScaler's skipped steps (plain torch)."""
    model = copy.deepcopy(model) if model is not None else case.build()
    model.train()
    data = case.data()
    opt = torch.optim.Adam(model.parameters(), lr=case.lr)
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs) if scaler_kwargs is not None else None
    losses, skipped = [], 0
    for i in order(len(data), steps, seed):
        x, y = data[i]
        opt.zero_grad(set_to_none=True)
        if precision == "fp32":
            loss = case.loss(model(x), (x, y))
        else:
            with torch.autocast("cpu", dtype=DTYPES[precision]):
                loss = case.loss(model(x), (x, y))
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]) and scaler is None:
            break  # an unscaled run cannot recover from a non-finite loss
        if scaler is not None:
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += int(scaler.get_scale() < before)
        else:
            loss.backward()
            opt.step()
    return losses, skipped


def gradients(case: Case, batch: tuple[torch.Tensor, torch.Tensor], precision: str, scale: float = 1.0,
              model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of one step from the initial weights, or ``model``'s (low precision: loss * scale,
    then / scale)."""
    model = copy.deepcopy(model) if model is not None else case.build()
    model.train()
    x, _ = batch
    if precision == "fp32":
        loss = case.loss(model(x), batch)
    else:
        with torch.autocast("cpu", dtype=DTYPES[precision]):
            loss = case.loss(model(x), batch)
    (loss.float() * scale).backward()
    return {n: p.grad.double() / scale for n, p in model.named_parameters() if p.grad is not None}


def error_and_noise(case: Case, precision: str, scale: float, model: torch.nn.Module | None = None,
                    batches: int = NOISE_BATCHES) -> list[tuple[str, float, float, float]]:
    """(parameter, low-precision error, batch-to-batch noise, the error's consistency) per parameter, as the profile
    judges the first two.

    Over the first ``batches`` batches b: the error is sqrt(sum_b ||g_low,b - g_32,b||^2 / sum_b ||g_32,b||^2), the
    noise sqrt(sum_b ||g_32,b - mean||^2 / (k - 1) / (sum_b ||g_32,b||^2 / k)): one batch's noise as a share of a
    batch gradient's RMS norm (fp16probe.capture.noise's estimator, here in plain torch). The consistency is
    ||mean_b e_b|| / mean_b ||e_b|| of the error vectors e_b = g_low,b - g_32,b: 1 for an error the same on every
    batch (a bias, which averaging over steps does not shrink), about 1/sqrt(k) for independent ones.
    """
    data = case.data()[:batches]
    k = len(data)
    g32 = [gradients(case, b, "fp32", model=model) for b in data]
    low = [gradients(case, b, precision, scale, model=model) for b in data]
    out = []
    for n in g32[0]:
        square = sum(float(g[n].square().sum()) for g in g32)
        if square == 0:
            continue
        mean = sum(g[n] for g in g32) / k
        spread = sum(float((g[n] - mean).square().sum()) for g in g32)
        err = (math.sqrt(sum(float((lo[n] - g[n]).square().sum()) for lo, g in zip(low, g32)) / square)
               if all(n in lo for lo in low) else math.inf)
        errors = [lo[n] - g[n] for lo, g in zip(low, g32)] if math.isfinite(err) else []
        norms = sum(float(e.norm()) for e in errors)
        consistency = float((sum(errors) / k).norm()) / (norms / k) if norms > 0 else math.nan
        out.append((n, err, math.sqrt(spread / (k - 1) / (square / k)), consistency))
    return out


def max_ratio(per_param: list[tuple[str, float, float, float]]) -> tuple[float, float]:
    """The largest error/noise over parameters and that parameter's error consistency (nan, nan when no error is
    finite: a non-finite step)."""
    ratios = [(e / s, c) for _, e, s, c in per_param if s > 0 and math.isfinite(e)]
    return max(ratios) if ratios else (math.nan, math.nan)


def trained_fp32(case: Case, steps: int) -> torch.nn.Module:
    """The model after ``steps`` fp32 Adam steps in seed 0's data order: the weights near the end of training."""
    model = case.build()
    model.train()
    data = case.data()
    opt = torch.optim.Adam(model.parameters(), lr=case.lr)
    for i in order(len(data), steps, 0):
        x, y = data[i]
        opt.zero_grad(set_to_none=True)
        case.loss(model(x), (x, y)).backward()
        opt.step()
    return model


def verdict(case: Case) -> tuple[str, dict[str, Any]]:
    """The tool's verdict on the case and its GradScaler settings (the first four batches, CPU's autocast)."""
    data = case.data()[:4]
    report = fp16probe.profile(case.build(), data, case.loss, steps=len(data), format=case.format, target="cpu")
    rec = report.recommendation
    return str(rec.verdict), scaler_settings(rec)


def scaler_settings(rec: Any) -> dict[str, Any]:
    """The answer's GradScaler settings; with no scale of its own (a forward or gradient-error verdict), the scale
    its gradients' verdict stands on; ``none_needed`` (no scale at all): ``enabled=False``, the line the answer
    pastes (GradScaler's defaults would start at 2^16 and skip steps backing off, which the answer does not do)."""
    kwargs = dict(rec.grad_scaler_kwargs)
    k = rec.evidence.get("backward_log2_scale") if isinstance(rec.evidence, dict) else None
    if "init_scale" not in kwargs and k is not None:
        kwargs["init_scale"] = math.ldexp(1.0, int(k))
    if not kwargs and str(rec.verdict) == "none_needed":
        kwargs["enabled"] = False
    return kwargs


def run_case(case: Case, steps: int, seeds: int, precision: str | None = None,
             scaler_kwargs: dict[str, Any] | None = None, label: str | None = None) -> dict[str, Any]:
    """One row of the table."""
    v, kwargs = verdict(case)
    precision = precision or case.format
    if scaler_kwargs is None:
        scaler_kwargs = kwargs if precision == "fp16" else None
    scale = float(scaler_kwargs.get("init_scale", 1.0)) if scaler_kwargs else 1.0
    per_param = error_and_noise(case, precision, scale)
    finite = [(n, e, s) for n, e, s, _ in per_param if math.isfinite(e)]
    worst = max(finite, key=lambda t: t[1]) if finite else (per_param[0][:3] if per_param else ("-", math.nan, math.nan))
    late, _ = max_ratio(error_and_noise(case, precision, scale, model=trained_fp32(case, steps)))
    ratio, consistency = max_ratio(per_param)
    fp32 = [train(case, "fp32", s, steps)[0] for s in range(seeds)]
    low_runs = [train(case, precision, s, steps, scaler_kwargs) for s in range(seeds)]
    band = judge_curves(fp32, [c for c, _ in low_runs])
    return {"case": label or case.name, "format": precision, "verdict": v, "scale": scale,
            "worst": worst, "max_ratio": ratio, "consistency": consistency, "late_ratio": late,
            "band": band, "skipped": sum(k for _, k in low_runs), "what": case.what}


def rows(steps: int, seeds: int, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Every case's row (and the loss-weight case at S = 1 besides)."""
    out = []
    for name, case in CASES.items():
        if names and name not in names:
            continue
        out.append(run_case(case, steps, seeds))
        if name.startswith("loss_weight"):
            out.append(run_case(case, steps, seeds, "fp16", {"init_scale": 1.0, "growth_interval": 10**9},
                                label=f"{name} at S = 1"))
    return out


def naive_variance_at(bias: float) -> Case:
    """The cancelling variance (``naive_variance``) with its Linear's bias at ``bias``: the bias dials fp16's error
    (E[x^2] and E[x]^2 grow as bias^2 while their difference, the variance, stays about 1)."""
    from tests.fixtures.evidence_models import NaiveNorm

    def build() -> torch.nn.Module:
        model = NaiveNorm()
        with torch.no_grad():
            model.inp.bias.fill_(float(bias))
        return model

    base = CASES["naive_variance"]
    return dataclasses.replace(base, name=f"naive_variance bias {bias:g}", build=build,
                               what=f"E[x^2]-E[x]^2 variance after a Linear with bias {bias:g}")


def _g(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:.3g}"


def table(found: list[dict[str, Any]]) -> str:
    """The Markdown table of docs/evidence.md."""
    lines = ["| case | format | tool's verdict | S | worst error (param) | its noise | max error/noise | "
             "its consistency | max error/noise after fp32 training | fp32 band (last-k mean) | low precision (last-k means) | inside | "
             "skipped |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in found:
        b: Band = r["band"]
        name, err, noise = r["worst"]
        lines.append(
            f"| {r['case']} | {r['format']} | {r['verdict']} | {r['scale']:g} | {err * 100:.3g}% ({name}) | "
            f"{noise * 100:.3g}% | {_g(r['max_ratio'])} | {_g(r['consistency'])} | {_g(r['late_ratio'])} | [{_g(b.low)}, {_g(b.high)}] | "
            f"{', '.join(_g(v) for v in b.target)} | {'yes' if b.inside else 'NO'} | {r['skipped']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--cases", nargs="*", default=None, choices=list(CASES))
    p.add_argument("--naive-bias", nargs="+", type=float, default=None, metavar="BIAS",
                   help="instead of the cases: the cancelling variance at these biases (docs/evidence.md's sweep)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.naive_bias:
        print(table([run_case(naive_variance_at(b), a.steps, a.seeds) for b in a.naive_bias]))
    else:
        print(table(rows(a.steps, a.seeds, a.cases)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
