"""What should GradScaler's growth interval be? Six small model families trained in fp16, their histories replayed.

Each family is trained for real under CPU fp16 autocast with ``torch.amp.GradScaler("cpu")`` and a
``Probe`` recording every step's scale, inf/NaN and largest gradient (the history) with fp32 shadow
reruns on its sampled steps (the flushed-share reference). On that history
:mod:`fp16probe.analysis.schedule` replays a grid of rules: growth interval {50, 100, 200, 400,
1000, 2000, 5000, 10000, never} x growth factor {2, 4} x backoff {0.5, 0.25}, and DeepSpeed's and
Megatron's hysteresis rules (interval 1000, hysteresis 2, floor 1). Every rule starts at the run's
initial scale (``INIT_SCALE``, above where these models' gradients overflow, so that every rule
meets overflows: at GradScaler's 2^16 a tiny model may never overflow and skipped steps would mean
nothing). Per rule: skipped steps; the mean share of gradients flushed at the scale in force and
the steps spent below the scale the data needed (flushing more than 0.1%), both from the shadow's
fp32 histograms moved with each step's largest gradient; and the emulated gradient error at the
scale in force (:func:`fp16probe.capture.emulate.measure_effect`: relative L2 error of the
gradients against fp32) at ``error_samples`` evenly spaced steps, not every step (the emulated
step costs tens of forward passes' worth).

The full tier trains each family for 5000 steps: long enough that GradScaler's default interval (2000)
grows the scale twice after the start's backoffs, and 5000 once.
Three check runs per family train the same model, data and seed for real at three other growth
intervals (``checks``): each one's history replayed with its own rule must give its skipped steps
exactly (``own_equal``), and the replay of the same rule on the main history is the prediction
(``predicted``), whose difference from the real count is reported as it is (the check run's
weights leave the main run's at its first differing skip, so the two are different runs).

    python bench/interval_study.py                      # all families (docs/interval-study.md)
    python bench/interval_study.py --family gpt2        # one family's row, exactly, on the same torch
    python bench/interval_study.py --quick --out /tmp/q.json   # the CI tier: tiny steps, same code path
    python bench/interval_study.py --merge gpt2.json bert.json --out study.json   # --family outputs as one study
    python bench/interval_study.py --family vit --seed 1   # the same family from other weights and data order

Torch runs on one thread with fixed seeds; the same command gives the same JSON (all but each
family's ``cpu_seconds``) on the same torch and Python (the GPT-2, BERT, T5 and LSTM families read the standard library's top-level ``.py``
files, in sorted order, as their text).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fp16probe import Probe  # noqa: E402
from fp16probe.analysis.interval_study import NEVER_GROWS, choose, drift_per_1000  # noqa: E402
from fp16probe.analysis.replay import ScalerRule  # noqa: E402
from fp16probe.analysis.schedule import _arrays, _flush_refs, _replay  # noqa: E402
from fp16probe.capture.emulate import measure_effect  # noqa: E402
from fp16probe.formats import get_format  # noqa: E402

INIT_SCALE = 2.0**24
NEVER = NEVER_GROWS  # a growth interval no run reaches: the scale never grows
INTERVALS = (50, 100, 200, 400, 1000, 2000, 5000, 10000, NEVER)
FACTORS = ((2.0, 0.5), (2.0, 0.25), (4.0, 0.5), (4.0, 0.25))
TAU = 1e-3  # a step flushing more than this share is below the scale the data needed
DEFAULTS = "defaults"


@dataclass(frozen=True)
class Tier:
    steps: int
    history_interval: int  # the main run's growth interval
    checks: tuple[int, int, int]  # the check runs' growth intervals
    every: int  # the Probe's sampling (the shadow reruns one sampled step in 50)
    error_samples: int
    error_log2: tuple[int, ...]  # the loss scales (log2) the emulated step measures


FULL = Tier(steps=5000, history_interval=100, checks=(50, 400, 2000), every=4, error_samples=4,
            error_log2=tuple(range(4, 25, 2)))
QUICK = Tier(steps=40, history_interval=10, checks=(5, 20, 40), every=1, error_samples=1,
             error_log2=(8, 12, 16, 20, 24))


# -- data -----------------------------------------------------------------------------------

_TEXT: np.ndarray | None = None


def stdlib_text() -> np.ndarray:
    """The standard library's top-level .py sources, in sorted order, as bytes (uint8)."""
    global _TEXT
    if _TEXT is None:
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        _TEXT = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8).copy()
    return _TEXT


def text_windows(g: torch.Generator, batch: int, length: int) -> torch.Tensor:
    text = stdlib_text()
    starts = torch.randint(0, len(text) - length - 1, (batch,), generator=g).tolist()
    return torch.from_numpy(np.stack([text[s:s + length] for s in starts]).astype(np.int64))


def images(g: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """16x16 RGB noise with a bright 4x4 patch in one of four quadrants; the class is the quadrant."""
    y = torch.randint(0, 4, (batch,), generator=g)
    x = torch.randn(batch, 3, 16, 16, generator=g) * 0.5
    for i, c in enumerate(y.tolist()):
        r, col = (c // 2) * 8 + 2, (c % 2) * 8 + 2
        x[i, :, r:r + 4, col:col + 4] += 2.0
    return x, y


# -- families: a model and a loss on a batch --------------------------------------------------

@dataclass(frozen=True)
class Family:
    name: str
    kind: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    lr: float


def _gpt2() -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> nn.Module:
    import transformers

    cfg = transformers.BertConfig(vocab_size=257, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _bert_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = text_windows(g, 8, 32)
    mask = torch.rand(ids.shape, generator=g) < 0.15
    mask[:, 0] = True  # at least one masked byte per row
    return ids.masked_fill(mask, 256), ids.masked_fill(~mask, -100)


def _t5() -> nn.Module:
    import transformers

    cfg = transformers.T5Config(vocab_size=256, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def _t5_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = text_windows(g, 8, 16)
    return ids, ids.flip(1)  # seq2seq: the window reversed


class _Block(nn.Module):
    def __init__(self, c: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c if stride == 1 else c // 2, c, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(c)
        self.skip = (nn.Identity() if stride == 1 else
                     nn.Sequential(nn.Conv2d(c // 2, c, 1, stride, bias=False), nn.BatchNorm2d(c)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.skip(x))


def _resnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         _Block(8, 1), _Block(16, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


class _ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, 32))
        self.pos = nn.Parameter(torch.randn(1, 17, 32) * 0.02)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(len(x), -1, -1), p], 1) + self.pos
        return self.head(self.encoder(h)[:, 0])


class _LSTM(nn.Module):
    """A 2-layer LSTM written out in Linear gates: CPU fp16 autocast has no kernel for nn.LSTM (oneDNN refuses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.gates = nn.ModuleList([nn.Linear(32 + 64, 4 * 64), nn.Linear(64 + 64, 4 * 64)])
        self.out = nn.Linear(64, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for gate in self.gates:
            h = c = x.new_zeros(len(ids), 64)
            ys = []
            for t in range(x.shape[1]):
                i, f, g, o = gate(torch.cat([x[:, t], h.to(x.dtype)], 1)).chunk(4, 1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                ys.append(h)
            x = torch.stack(ys, 1)
        return self.out(x)


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt2", "byte-level GPT-2 LM (transformers) on the stdlib's .py sources", _gpt2,
           lambda g: text_windows(g, 8, 32), lambda m, ids: m(input_ids=ids, labels=ids).loss, 1e-3),
    Family("bert", "BERT-style masked LM (transformers) on the stdlib's .py sources", _bert, _bert_batch,
           lambda m, b: m(input_ids=b[0], labels=b[1]).loss, 1e-3),
    Family("t5", "T5-style seq2seq (transformers): reverse a 16-byte window of the stdlib's sources", _t5, _t5_batch,
           lambda m, b: m(input_ids=b[0], labels=b[1]).loss, 1e-3),
    Family("resnet", "ResNet with BatchNorm (torch): which quadrant holds a bright patch, 16x16 noise", _resnet,
           lambda g: images(g, 16), lambda m, b: _ce(m(b[0]), b[1]), 1e-3),
    Family("vit", "ViT (torch, 4x4 patches): the same image task", _ViT, lambda g: images(g, 16),
           lambda m, b: _ce(m(b[0]), b[1]), 1e-3),
    Family("lstm", "2-layer LSTM byte LM (torch) on the stdlib's .py sources", _LSTM,
           lambda g: text_windows(g, 8, 17), lambda m, ids: _ce(m(ids[:, :-1]), ids[:, 1:]), 2e-3),
)}


# -- one real fp16 run -------------------------------------------------------------------------

def train(fam: Family, tier: Tier, interval: int, *, shadow: bool, keep_at: tuple[int, ...] = (), seed: int = 0):
    """Train ``fam`` for ``tier.steps`` fp16 steps with GradScaler(INIT_SCALE, growth_interval=interval), from the
    weights of ``seed`` over the data order of ``seed`` (the published study: seed 0).

    Returns the Probe's report, the real skipped steps (the scaler backed off: found_inf), and the
    weights and batch at the steps in ``keep_at`` (for the emulated step, run afterwards)."""
    torch.manual_seed(seed)
    model = fam.build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=fam.lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=interval)
    probe = Probe(model, scaler=scaler, every=tier.every if shadow else tier.steps, target="cpu",
                  shadow_every=None if shadow else 0).start()
    g = torch.Generator().manual_seed(1 + seed)
    skipped = 0
    kept: dict[int, tuple[dict[str, torch.Tensor], Any]] = {}
    try:
        for step in range(tier.steps):
            b = fam.batch(g)
            if step in keep_at:
                kept[step] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, b)
            if shadow:
                probe.shadow(lambda b=b: fam.loss(model, b))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = fam.loss(model, b)
            scaler.scale(loss).backward()
            s = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < s  # GradScaler backs off exactly when found_inf
            opt.zero_grad()
            probe.step()
    finally:
        probe.stop()
    return probe.report(), skipped, kept


def emulated_errors(fam: Family, tier: Tier, kept: dict[int, tuple[dict[str, torch.Tensor], Any]]) -> dict[int, dict[int, float | None]]:
    """Per kept step, per log2 scale: the emulated fp16 step's relative L2 gradient error against fp32 (None: overflow)."""
    out: dict[int, dict[int, float | None]] = {}
    for step, (state, b) in sorted(kept.items()):
        torch.manual_seed(0)
        model = fam.build().train()
        model.load_state_dict(state)
        eff = measure_effect(model, [lambda model=model, b=b: fam.loss(model, b)], target="cpu",
                             settings=[(k, ()) for k in tier.error_log2])
        row: dict[int, float | None] = {}
        for s in eff["settings"]:
            params = s["params"]
            if any(p[0] is None for p in params) or any(p[4] for p in params):
                row[s["log2_scale"]] = None
            else:
                err, ref = sum(p[0] for p in params), sum(p[1] for p in params)
                row[s["log2_scale"]] = math.sqrt(err / ref) if ref > 0 else 0.0
        out[step] = row
    return out


# -- the grid replayed on the history ---------------------------------------------------------

def rules() -> list[tuple[str, ScalerRule]]:
    out = [(DEFAULTS, ScalerRule(INIT_SCALE, 2.0, 0.5, 2000))]
    for gi in INTERVALS:
        for gf, bf in FACTORS:
            label = "never" if gi == NEVER else str(gi)
            out.append((f"{label} x{gf:g} /x{1 / bf:g}", ScalerRule(INIT_SCALE, gf, bf, gi)))
    out.append(("DeepSpeed", ScalerRule(INIT_SCALE, 2.0, 0.5, 1000, hysteresis=2, min_scale=1.0, deepspeed_window=True)))
    out.append(("Megatron", ScalerRule(INIT_SCALE, 2.0, 0.5, 1000, hysteresis=2, min_scale=1.0)))
    return out


def drift(report) -> float | None:
    """The least-squares slope of log2 max|g| over the run's clean steps, per 1000 steps."""
    h = report.history
    return drift_per_1000(range(h.first_step, h.first_step + len(h)), h.grad_max)


def replay_grid(report, errors: dict[int, dict[int, float | None]], tier: Tier) -> list[dict[str, Any]]:
    fmt = get_format("fp16")
    refs, reference = _flush_refs(report, "all")
    steps = _arrays(report.history, refs)
    lo, hi = min(tier.error_log2), max(tier.error_log2)
    out = []
    for name, rule in rules():
        row, scales, skipped = _replay(steps, fmt, rule, TAU, reference is not None)
        errs = []
        for t, by_scale in errors.items():
            if skipped[t]:
                continue
            k = min(max(int(math.floor(math.log2(scales[t]))), lo), hi)
            e = by_scale.get(max(g for g in tier.error_log2 if g <= k))  # the measured scale at or below
            if e is not None:
                errs.append(e)
        out.append({"rule": name, "growth_interval": rule.growth_interval, "growth_factor": rule.growth_factor,
                    "backoff_factor": rule.backoff_factor, "hysteresis": rule.hysteresis,
                    "skipped_steps": row.skipped_steps, "mean_flushed_fraction": row.mean_flushed_fraction,
                    "steps_below_needed": row.steps_over_threshold,
                    "gradient_error": float(np.mean(errs)) if errs else None,
                    "error_samples": len(errs), "uncertain_steps": row.uncertain_steps,
                    "backoffs": row.backoffs, "growths": row.growths, "final_scale": row.final_scale})
    return out


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rule of the whole grid skipping fewest steps at no more flushed share, steps below the needed scale
    and gradient error than the defaults (ties: less flushed, then the longer interval)."""
    return dict(choose(rows, defaults_factors=False))


def study(fam: Family, tier: Tier, seed: int = 0) -> dict[str, Any]:
    t0 = time.process_time()
    samples = tuple(int(i) for i in np.linspace(tier.steps // (tier.error_samples + 1), tier.steps - 1,
                                                 tier.error_samples, dtype=np.int64))
    report, real_skipped, kept = train(fam, tier, tier.history_interval, shadow=True, keep_at=samples, seed=seed)
    errors = emulated_errors(fam, tier, kept)
    rows = replay_grid(report, errors, tier)
    own = next(r for r in rows if r["rule"] == f"{tier.history_interval} x2 /x2") if tier.history_interval in INTERVALS \
        else None
    refs, reference = _flush_refs(report, "all")
    steps_main = _arrays(report.history, refs)
    checks = []
    for gi in tier.checks:
        rule = ScalerRule(INIT_SCALE, 2.0, 0.5, gi)
        rep, real, _ = train(fam, tier, gi, shadow=False, seed=seed)
        own_row, _, _ = _replay(_arrays(rep.history, []), get_format("fp16"), rule, TAU, False)
        pred_row, _, _ = _replay(steps_main, get_format("fp16"), rule, TAU, False)
        checks.append({"growth_interval": gi, "real": int(real), "own_replay": own_row.skipped_steps,
                       "own_equal": own_row.skipped_steps == real, "predicted": pred_row.skipped_steps})
    main_own, _, _ = _replay(steps_main, get_format("fp16"), ScalerRule(INIT_SCALE, 2.0, 0.5, tier.history_interval),
                             TAU, False)
    chosen = best(rows)
    return {"family": fam.name, "kind": fam.kind, "seed": seed,
            "parameters": sum(p.numel() for p in fam.build().parameters()),
            "steps": tier.steps, "init_scale": INIT_SCALE, "history_interval": tier.history_interval,
            "history_real_skipped": int(real_skipped), "history_own_replay": main_own.skipped_steps,
            "flush_reference": reference, "drift_log2_per_1000": drift(report),
            "error_steps": list(errors), "rows": rows, "checks": checks, "best": chosen["rule"],
            "best_vs_defaults": {"skipped": rows[0]["skipped_steps"] - chosen["skipped_steps"]},
            "history_rule_row": own["rule"] if own else None,
            "cpu_seconds": round(time.process_time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES), help="one family (repeatable); default all")
    ap.add_argument("--quick", action="store_true", help="the CI tier: tiny steps, the same code path")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (default: print it)")
    ap.add_argument("--seed", type=int, default=0,
                    help="the weights' and data order's seed (default 0, the published study; 1: its second seed)")
    ap.add_argument("--merge", nargs="+", type=Path, default=None,
                    help="merge these --family outputs (same tier) into one study, in the study's order; trains nothing")
    args = ap.parse_args(argv)
    if args.merge:
        parts = [json.loads(p.read_text()) for p in args.merge]
        fams = {f["family"]: f for part in parts for f in part["families"]}
        merged = {**parts[0], "families": [fams[n] for n in FAMILIES if n in fams]}
        text = json.dumps(merged, indent=1) + "\n"
        if args.out is None:
            sys.stdout.write(text)
        else:
            args.out.write_text(text)
        return 0
    torch.set_num_threads(1)
    tier = QUICK if args.quick else FULL
    names = args.family or list(FAMILIES)
    results = [study(FAMILIES[n], tier, args.seed) for n in names]
    out = {"tier": "quick" if args.quick else "full", "torch": torch.__version__, "python": platform.python_version(),
           "tier_settings": {"steps": tier.steps, "history_interval": tier.history_interval, "checks": list(tier.checks),
                             "every": tier.every, "error_samples": tier.error_samples,
                             "error_log2": list(tier.error_log2)},
           "families": results}
    text = json.dumps(out, indent=1) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
