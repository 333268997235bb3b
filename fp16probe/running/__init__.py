"""Running: load a model, make its inputs and loss, run the probed steps, and prove the advice.

- ``profile.py``: :func:`fp16probe.profile`, the one path every entry point takes (checks,
  the run loop, the partial report on Ctrl-C, SIGTERM or a failure, the analysis).
- ``verify.py``: :func:`fp16probe.verify`, the recommended setting run for real in fp16/bf16.
- ``inputs.py`` (batches: the caller's, the demo's, synthetic), ``losses.py``,
  ``optimizers.py``, ``families.py`` (per-family inputs and losses), ``loading.py`` and
  ``archive.py`` (MODEL, safely), ``demo.py`` (the built-in demo).
"""
