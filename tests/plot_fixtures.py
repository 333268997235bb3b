"""Reports for the picture tests: one built by hand, one from a tiny Probe run."""

from __future__ import annotations

import torch
from torch import nn

from fp16probe import Probe
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD, Histogram, Metadata, ModuleStats, Report, StepTrace

# Per-module activation-gradient bins {e: count} for magnitudes in (2^(e-1), 2^e].
# "head" sits in fp16's normal range, "mid" straddles min normal, "deep" is mostly
# below the flush threshold 2^-25, as in LIT-011's Figure 3.
HAND_MODULES = {
    "head": ({-10: 400, -8: 300, -6: 100}, 200),
    "mid": ({-20: 300, -16: 200, -13: 100}, 400),
    "deep": ({-40: 250, -30: 150, -26: 100, -25: 50, -22: 50}, 1000),
}


def hand_report(steps: int = 6) -> Report:
    """A report whose every number is known in closed form.

    Each step sees the same counts, so the merged module histograms are ``steps`` times
    HAND_MODULES; step 3 also holds one large gradient (2^10) that overflows fp16 for
    S >= 2^6, so the what-if table and the replay have something to back off from.
    """
    modules = []
    per_step = []
    for order, (name, (bins, zeros)) in enumerate(HAND_MODULES.items()):
        h = Histogram.from_values({e: c * steps for e, c in bins.items()}, zero=zeros * steps)
        modules.append(ModuleStats(name, ACTIVATION_GRAD, "Linear", order, h))
    step_hist = Histogram.sum(Histogram.from_values(b, zero=z) for b, z in HAND_MODULES.values())
    big = Histogram.from_values({10: 1})
    for i in range(steps):
        per_step.append(step_hist + big if i == 3 else step_hist)
    modules.append(ModuleStats("head", WEIGHT_GRAD, "Linear", 0, Histogram.from_values({-12: 64 * steps})))
    # the module histograms must agree with the trace: put the big value in "head"
    modules[0] = ModuleStats("head", ACTIVATION_GRAD, "Linear", 0, modules[0].histogram + big)
    trace = StepTrace(
        steps=tuple(range(steps)),
        histograms={ACTIVATION_GRAD: tuple(per_step),
                     WEIGHT_GRAD: tuple(Histogram.from_values({-12: 64}) for _ in range(steps))},
        module_max={ACTIVATION_GRAD: {n: tuple(2.0 ** max(b) for _ in range(steps))
                                      for n, (b, _z) in HAND_MODULES.items()}},
        scale=(None,) * steps,
        found_inf=(False,) * steps,
    )
    meta = Metadata(fp16probe_version="test", torch_version=torch.__version__, device="cpu",
                    model_class="HandBuilt", steps_seen=steps, steps_total=steps,
                    captured=(ACTIVATION_GRAD, WEIGHT_GRAD), hooked_modules=tuple(HAND_MODULES))
    return Report(metadata=meta, modules=tuple(modules), trace=trace)


class TinyDense(nn.Module):
    """A per-pixel classifier: its loss is a mean over batch x pixels, so gradients are small."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act2 = nn.ReLU()
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.conv2(self.act1(self.conv1(x)))))


def probe_report(steps: int = 4) -> Report:
    """A real Probe run on TinyDense, on the CPU, in well under a second."""
    torch.manual_seed(0)
    model = TinyDense()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3, 12, 12)
    y = torch.randint(0, 4, (8, 12, 12))
    with Probe(model) as probe:
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.step()
    return probe.report()
