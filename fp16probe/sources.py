"""The works the analyzer's rules and constants come from, as records a report stores.

Each is a :class:`~fp16probe.recommendation.Citation` (who, what, where to find it), not a
sentence: analysis attaches records to its answers, a report file stores them as objects, and
presentation writes them as a line (``presentation.cite``).

Two sources for FP16 loss scaling, with a division of labour the words must respect:

* Micikevicius et al., *Mixed Precision Training*, arXiv:1710.03740, says *why*:
  FP16 gradients underflow, a constant loss scale S shifts them into range, and S can be
  picked so that S x max|g| stays below the format's max. It prescribes no schedule.
* NVIDIA's *Train With Mixed Precision* guide supplies the dynamic-scaling constants
  (growth every 2000 steps, x2, x0.5) as settings it trained with successfully, saying in
  the same breath that many other settings are valid. ``torch.amp.GradScaler`` ships them
  as defaults, with init_scale 65536.

So 2000 is a widely-run, once-validated default, not a measured optimum, and it is not
the paper's. What the interval costs against the alternatives is measured by this project's
own growth-interval study (:data:`INTERVAL_STUDY`, docs/interval-study.md), which the answer
cites where it uses it. ``tests/fixtures/wording.py`` (``wording_problems``), a lint the tests run over
every verdict's text, checks any text against these rules.
"""

from __future__ import annotations

from fp16probe.recommendation import GRADSCALER_DEFAULTS, Citation

__all__ = [
    "BLOCK_FORMATS",
    "DEEPSPEED_SCALER",
    "FRAMEWORK_SOURCES",
    "FP16_RL",
    "MEGATRON_SCALER",
    "RELAX_SCALER",
    "VERL_SCALER",
    "FP8_FORMATS",
    "GRADSCALER",
    "GRPO",
    "INTERVAL_STUDY",
    "MIXED_PRECISION_TRAINING",
    "MXFP8_RECIPES",
    "MX_SPECIFICATION",
    "MICROSCALING",
    "RL_FP16_MISMATCH",
    "NVFP4_PRETRAINING",
    "NVIDIA_GUIDE",
    "NVIDIA_GUIDE_URL",
    "TRANSFORMER_ENGINE",
]


NVIDIA_GUIDE_URL = "https://docs.nvidia.com/deeplearning/performance/mixed-precision-training/index.html"

# FP16 loss scaling
MIXED_PRECISION_TRAINING = Citation("Micikevicius et al.", "Mixed Precision Training", arxiv="1710.03740",
                                    note="ICLR 2018")
NVIDIA_GUIDE = Citation("NVIDIA", "Train With Mixed Precision", url=NVIDIA_GUIDE_URL, note="living guide")
GRADSCALER = Citation("PyTorch", "torch.amp.GradScaler",
                      url="https://docs.pytorch.org/docs/stable/amp.html#gradient-scaling",
                      note="defaults: " + ", ".join(f"{k}={v}" for k, v in GRADSCALER_DEFAULTS.items()))
# the project's own measurement of the growth interval (bench/interval_study.py; fp16probe.analysis.interval_study)
INTERVAL_STUDY = Citation(
    "fp16probe developers", "The growth-interval study: GradScaler's growth interval measured on six small model families",
    url="docs/interval-study.md", note="in the fp16probe repository; bench/interval_study.py reproduces it")
TRANSFORMER_ENGINE = Citation(
    "NVIDIA", "Transformer Engine: DelayedScaling recipe",
    url="https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/api/common.html",
    note="scale = fp8 max / amax / 2^margin")

# the scaled formats (analysis.blockformats)
FP8_FORMATS = Citation("Micikevicius et al.", "FP8 Formats for Deep Learning", arxiv="2209.05433")
MX_SPECIFICATION = Citation(
    "Open Compute Project", "OCP Microscaling Formats (MX) Specification", note="version 1.0",
    url="https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf")
MICROSCALING = Citation("Rouhani et al.", "Microscaling Data Formats for Deep Learning", arxiv="2310.10537")
MXFP8_RECIPES = Citation("Mishra et al.", "Recipes for Pre-training LLMs with MXFP8", arxiv="2506.08027")
NVFP4_PRETRAINING = Citation("NVIDIA", "Pretraining Large Language Models with NVFP4", arxiv="2509.25149")
BLOCK_FORMATS = (FP8_FORMATS, MX_SPECIFICATION, MICROSCALING, MXFP8_RECIPES, NVFP4_PRETRAINING)

# the train-inference mismatch (running.mismatch)
RL_FP16_MISMATCH = Citation("Qi et al.", "Defeating the Training-Inference Mismatch via FP16", arxiv="2510.26788")
# RL post-training objectives (running.rl)
GRPO = Citation("Shao et al.",
                "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
                arxiv="2402.03300", note="group relative policy optimization (GRPO)")
# The RL frameworks' shipped loss scalers (analysis.schedule.FRAMEWORK_RULES)
FP16_RL = RL_FP16_MISMATCH  # the same work, named for the schedule's framework rows
VERL_SCALER = Citation("verl", "FSDP ShardedGradScaler(growth_interval=400) for fp16 (PR #4036)",
                       url="https://github.com/volcengine/verl/pull/4036", note="the FP16 paper's own patch")
DEEPSPEED_SCALER = Citation(
    "DeepSpeed", "deepspeed/runtime/fp16/loss_scaler.py and the fp16 config options",
    url="https://www.deepspeed.ai/docs/config-json/#fp16-training-options",
    note="initial_scale_power 16, loss_scale_window 1000, hysteresis 2, min_loss_scale 1; Oat uses it as shipped")
MEGATRON_SCALER = Citation(
    "NVIDIA", "Megatron-LM megatron/training/arguments.py and megatron/core/optimizer/grad_scaler.py",
    url="https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/training/arguments.py",
    note="initial loss scale 2^32, window 1000, hysteresis 2, min 1")
RELAX_SCALER = Citation("Relax", "initial_loss_scale=32768, min_loss_scale=1 on Megatron's scaler",
                        note="not checked against Relax's source here; window and hysteresis are Megatron's defaults")
FRAMEWORK_SOURCES = {"verl": VERL_SCALER, "deepspeed": DEEPSPEED_SCALER, "megatron": MEGATRON_SCALER,
                     "relax": RELAX_SCALER}
