"""A GAN-style loop under the live Probe: two models, two real ``GradScaler("cpu")``, losses outside the models.

The generator G and the discriminator D each get their own optimizer, scaler and Probe; the losses
are computed outside the models, so each step calls ``probe.shadow(fn)`` before its forward. The
run is CPU fp16 autocast. Checked against plain torch: the same loop without the Probes (weights
equal bit for bit, also when the probed run is the first in a fresh process: issue 39 saw 15 of 15
processes differ there), and an fp32 run of the same loop whose Probes see only the loss each
model backpropagates (D's own loss for D: in the fp32 reference, G's step runs through a copy of D
with no Probe on it, which changes no weight, since D's gradients are cleared before D's step).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fp16probe import Probe
from fp16probe.analysis.recommend import analyze
from fp16probe.presentation.verdict import verdict_text

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
TINY = 1e-5  # the losses' weight: gradients low enough that fp16 needs a loss scale


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    d = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))  # dropout: RNG draws
    return g, d


def train(*, probe: bool, fp16: bool = True, own_losses: bool = False) -> tuple[list[torch.Tensor], Probe | None,
                                                                               Probe | None]:
    """STEPS GAN steps (D's, then G's); the final weights of G and D, and the two Probes (or None)."""
    G, D = _nets()
    _, D_for_g = _nets()  # with own_losses: G's step runs through this copy of D, which no Probe watches
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    scaler_g = torch.amp.GradScaler("cpu", enabled=fp16)
    scaler_d = torch.amp.GradScaler("cpu", enabled=fp16)
    probe_g = Probe(G, scaler=scaler_g if fp16 else None).start() if probe else None
    probe_d = Probe(D, scaler=scaler_d if fp16 else None).start() if probe else None
    gen = torch.Generator().manual_seed(1)
    reals = [torch.randn(8, 8, generator=gen) * 1e-2 for _ in range(STEPS)]
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    torch.manual_seed(5)  # the noise draws
    for real in reals:
        z = torch.randn(8, 4)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            fake = G(z).detach()

        def d_loss() -> torch.Tensor:
            return (F.binary_cross_entropy_with_logits(D(real), ones)
                    + F.binary_cross_entropy_with_logits(D(fake.float()), zeros)) * TINY

        if probe_d is not None:
            probe_d.shadow(d_loss)
        opt_d.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss_d = d_loss()
        scaler_d.scale(loss_d).backward()
        scaler_d.step(opt_d)
        scaler_d.update()
        if probe_d is not None:
            probe_d.step()

        critic = D
        if own_losses:
            D_for_g.load_state_dict(D.state_dict())
            critic = D_for_g

        def g_loss() -> torch.Tensor:
            return F.binary_cross_entropy_with_logits(critic(G(z)), ones) * TINY

        if probe_g is not None:
            probe_g.shadow(g_loss)
        opt_g.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss_g = g_loss()
        scaler_g.scale(loss_g).backward()
        scaler_g.step(opt_g)
        scaler_g.update()
        if probe_g is not None:
            probe_g.step()
    for p in (probe_g, probe_d):
        if p is not None:
            p.stop()
    return [t.detach().clone() for t in (*G.parameters(), *D.parameters())], probe_g, probe_d


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two runs' final weights are equal bit for bit."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def first_run_identical() -> bool:
    """In this process: the probed loop first, then the plain one; whether they end bit-identical."""
    probed, _, _ = train(probe=True)
    plain, _, _ = train(probe=False)
    return same(probed, plain)


def test_each_models_live_verdict_is_its_own_losss_fp32_reference_and_training_is_unchanged():
    probed, probe_g, probe_d = train(probe=True)
    plain, _, _ = train(probe=False)
    assert same(probed, plain)
    _, ref_g, ref_d = train(probe=True, fp16=False, own_losses=True)
    for probe, ref in ((probe_g, ref_g), (probe_d, ref_d)):
        assert probe is not None and ref is not None
        report = probe.report()
        assert report.shadow_runs.steps == (0, 1, 2, 4, 8) and not report.shadow_runs.discarded
        rec, fp32 = analyze(report), analyze(ref.report())
        assert rec.evidence["reference"] == "fp32_shadow_reruns", verdict_text(rec)
        assert rec.verdict in ("constant", "dynamic") and fp32.verdict in ("constant", "dynamic"), verdict_text(rec)
        assert rec.log2_scale >= 20  # the tiny losses need a scale: the comparison is not 0 against 0
        assert abs(rec.log2_scale - fp32.log2_scale) <= 1, (rec.log2_scale, fp32.log2_scale)


def test_the_first_probed_run_in_a_fresh_process_is_bit_identical_to_the_plain_one():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    code = "from tests.test_live_gan import first_run_identical; print('identical' if first_run_identical() else 'DIFFER')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "identical", done.stdout[-2000:]
