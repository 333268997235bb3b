"""The training trial's cost: run_trial (100 steps, 3 orders x 2 runs) against the same 600 steps in a plain torch loop.

Run from the repository root: python bench/trial_cost.py (CPU seconds, median of 3 interleaved rounds, one thread).
"""
import sys
import time

import torch
torch.set_num_threads(1)
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
import fp16probe  # noqa: E402
from tests.fixtures.evidence_models import CASES  # noqa: E402
from fp16probe.running.trial import run_trial  # noqa: E402
from fp16probe.running.losses import as_loss  # noqa: E402
from bench.evidence import train  # noqa: E402
for name in ("mlp", "bn_resnet_raw_pixels"):
    c = CASES[name]
    rep = fp16probe.profile(c.build(), c.data(), c.loss, steps=4, format=c.format, target="cpu")
    kw = dict(rep.recommendation.grad_scaler_kwargs) or None
    res = {"trial": [], "plain": []}
    for _round in range(3):
        t0 = time.process_time()
        run_trial(c.build(), rep.recommendation, c.data(), as_loss(c.loss), steps=100, device=torch.device("cpu"), target="cpu")
        res["trial"].append(time.process_time() - t0)
        t0 = time.process_time()
        for s in range(3):
            train(c, "fp32", s, 100)
            train(c, "fp16", s, 100, kw)
        res["plain"].append(time.process_time() - t0)
    print(name, {k: sorted(v)[1] for k, v in res.items()})
