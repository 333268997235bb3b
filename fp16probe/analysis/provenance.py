"""Where the analyzer's rules and constants come from, and the wording rules its text keeps.

Two sources, with a division of labour the text must respect:

* Micikevicius et al., *Mixed Precision Training*, arXiv:1710.03740, says *why*:
  FP16 gradients underflow, a constant loss scale S shifts them into range, and S can be
  picked so that S x max|g| stays below the format's max. It prescribes no schedule.
* NVIDIA's *Train With Mixed Precision* guide supplies the dynamic-scaling constants
  (growth every 2000 steps, x2, x0.5) as settings it trained with successfully, saying in
  the same breath that many other settings are valid. ``torch.amp.GradScaler`` ships them
  as defaults, with init_scale 65536.

So 2000 is a widely-run, once-validated default, not a measured optimum, and it is not
the paper's. ``tests/fixtures/wording.py`` (``wording_problems``), a lint the tests run over
every verdict's text, checks any text against these rules.
"""

from __future__ import annotations

from fp16probe.recommendation import GRADSCALER_DEFAULTS

__all__ = [
    "BLOCK_CITATIONS",
    "CITATION_GRADSCALER",
    "CITATION_NVIDIA_GUIDE",
    "CITATION_PAPER",
    "CITATION_TRANSFORMER_ENGINE",
    "GRADSCALER_DEFAULT_NOTE",
    "NVIDIA_GUIDE_URL",
    "PAPER",
    "SIMULATION_CAVEAT",
]

NVIDIA_GUIDE_URL = (
    "https://docs.nvidia.com/deeplearning/performance/mixed-precision-training/index.html"
)

PAPER = 'Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740'
CITATION_PAPER = f"{PAPER} (ICLR 2018)"
CITATION_NVIDIA_GUIDE = f'NVIDIA, "Train With Mixed Precision" (living guide), {NVIDIA_GUIDE_URL}'
CITATION_TRANSFORMER_ENGINE = (
    "NVIDIA Transformer Engine, DelayedScaling recipe (scale = fp8 max / amax / 2^margin), "
    "https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/api/common.html"
)
BLOCK_CITATIONS = (  # the scaled formats (analysis.blockformats)
    'Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433',
    "OCP Microscaling Formats (MX) Specification v1.0",
    'Rouhani et al., "Microscaling Data Formats for Deep Learning", arXiv 2310.10537',
    'Mishra et al., "Recipes for Pre-training LLMs with MXFP8", arXiv 2506.08027',
    'NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149',
)
CITATION_GRADSCALER = "torch.amp.GradScaler defaults: " + ", ".join(
    f"{k}={v}" for k, v in GRADSCALER_DEFAULTS.items()
)

GRADSCALER_DEFAULT_NOTE = (
    "GradScaler's default growth_interval (2000, from NVIDIA's guide at "
    f"{NVIDIA_GUIDE_URL}: one validated example among many valid settings, not a measured optimum)"
)
SIMULATION_CAVEAT = (
    "The long-horizon replay resamples the profiled steps (uniformly, with replacement, "
    "seeded), so it assumes future steps look like the profiled ones: a profile taken at "
    "nearly fixed weights cannot see the drift in gradient magnitudes that training brings."
)
