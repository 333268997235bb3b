"""The works the analyzer's rules and constants come from, as records a report stores.

A :class:`Citation` is a record (who, what, where to find it), not a sentence: analysis
attaches records to its answers, a report file stores them as objects, and presentation
writes them as a line (``presentation.cite``). An older report stored each citation as the
sentence it showed; :func:`citation_from_json` keeps such a sentence as it was.

Two sources for FP16 loss scaling, with a division of labour the words must respect:

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

from dataclasses import asdict, dataclass, fields
from typing import Any

from fp16probe.errors import ReportFieldError
from fp16probe.recommendation import GRADSCALER_DEFAULTS

__all__ = [
    "BLOCK_FORMATS",
    "FP8_FORMATS",
    "GRADSCALER",
    "MIXED_PRECISION_TRAINING",
    "MXFP8_RECIPES",
    "MX_SPECIFICATION",
    "MICROSCALING",
    "NVFP4_PRETRAINING",
    "NVIDIA_GUIDE",
    "NVIDIA_GUIDE_URL",
    "TRANSFORMER_ENGINE",
    "Cited",
    "Citation",
    "citation_from_json",
    "citation_to_json",
]


@dataclass(frozen=True)
class Citation:
    """One work: ``authors`` and ``title``, then where to find it (an ``arxiv`` id, a ``url``, or both).

    ``note`` is what the reader needs beside the title: where it appeared, which version, or
    what of it the tool uses (GradScaler's defaults, Transformer Engine's scale rule).
    """

    authors: str
    title: str
    arxiv: str = ""
    url: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, str]:
        """Return the JSON form: the non-empty fields."""
        return {k: v for k, v in asdict(self).items() if v}


Cited = Citation | str  # a record, or the sentence an older report stored


def citation_from_json(value: Any, path: str = "citations") -> Cited:
    """A stored citation: a record, or an older report's sentence kept as it was.

    A field that is not a string raises ReportFieldError naming it.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ReportFieldError(path, f"{path}: expected a citation object or a string, got {type(value).__name__}")
    known = {f.name for f in fields(Citation)}
    for key in ("authors", "title"):
        if not isinstance(value.get(key), str):
            raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected a string")
    for key, v in value.items():
        if key in known and not isinstance(v, str):
            raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected a string, got {type(v).__name__}")
    return Citation(**{k: v for k, v in value.items() if k in known})


def citation_to_json(c: Cited) -> dict[str, str] | str:
    """The stored form: a record's non-empty fields, or an older file's sentence as it was."""
    return c if isinstance(c, str) else c.to_dict()


NVIDIA_GUIDE_URL = "https://docs.nvidia.com/deeplearning/performance/mixed-precision-training/index.html"

# FP16 loss scaling
MIXED_PRECISION_TRAINING = Citation("Micikevicius et al.", "Mixed Precision Training", arxiv="1710.03740",
                                    note="ICLR 2018")
NVIDIA_GUIDE = Citation("NVIDIA", "Train With Mixed Precision", url=NVIDIA_GUIDE_URL, note="living guide")
GRADSCALER = Citation("PyTorch", "torch.amp.GradScaler",
                      url="https://docs.pytorch.org/docs/stable/amp.html#gradient-scaling",
                      note="defaults: " + ", ".join(f"{k}={v}" for k, v in GRADSCALER_DEFAULTS.items()))
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
