"""The README's second worked example: a Probe inside your own training loop."""

from __future__ import annotations

import torch

from docs.examples.my_model import batches, build, loss
from fp16probe import Probe, analyze

model = build()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
with Probe(model) as probe:                  # hooks every leaf module and parameter
    for _, batch in zip(range(20), batches()):
        loss(model(batch[0]), batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        probe.step()                         # one call per optimizer step
report = probe.report()                      # the only host synchronisation
report = report.with_recommendation(analyze(report, "fp16"))
report.save("loop-report.json")
print(report)                                # a short summary: verdict, S, shares, worst modules
