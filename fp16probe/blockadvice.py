"""The scaled-format answer as typed data: per layer what a recipe loses, the recipe to use, the layers to keep.

Shared data beside the :class:`~fp16probe.recommendation.Recommendation` (the loss-scale
answer for fp16/bf16/fp8): :func:`fp16probe.analysis.blockformats.advise` builds a
:class:`BlockAdvice` for FP8 recipes, MXFP8 and NVFP4, the report keeps it as its
``block_advice`` section, and ``presentation.blockview`` shows it. An older report kept the
same JSON in ``metadata.extra["block_advice"]``; it loads into the section.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fp16probe.blockscale import BlockCounts, DelayedRecipe
from fp16probe.errors import ReportFieldError
from fp16probe.formats import SCALED_FORMATS
from fp16probe.recommendation import Cited, citation_to_json, citations_from_json

__all__ = ["BlockAdvice", "LayerLoss"]


def _obj(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ReportFieldError(path, f"{path}: expected an object, got {type(v).__name__}")
    return v


def _get(d: Mapping[str, Any], key: str, path: str, types: tuple[type, ...], expected: str) -> Any:
    v = d.get(key)
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected {expected}, got {v!r}")
    return v


def _strings(d: Mapping[str, Any], key: str, path: str) -> tuple[str, ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected a list of strings")
    return tuple(v)


@dataclass(frozen=True)
class LayerLoss:
    """One layer under one recipe: counts per operand read, and the worst share lost."""

    module: str
    type: str
    reads: Mapping[str, BlockCounts]  # "kind/layout" -> counts
    loss: float  # the largest (flushed + saturated) / nonzero over the reads
    worst_read: str
    by_recipe: Mapping[str, float] = field(default_factory=dict)  # recipe -> loss

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (each read's counts with its flushed and saturated shares)."""
        return {"module": self.module, "type": self.type, "loss": self.loss, "worst_read": self.worst_read,
                "by_recipe": dict(self.by_recipe),
                "reads": {k: {**c.to_dict(), "flushed_share": c.share("flushed"),
                              "saturated_share": c.share("saturated")} for k, c in self.reads.items()}}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "layer") -> "LayerLoss":
        """Build from JSON; a bad field raises ReportFieldError naming it (the shares are recomputed)."""
        d = _obj(d, path)
        reads = _obj(d.get("reads", {}), f"{path}.reads")
        by = _obj(d.get("by_recipe", {}), f"{path}.by_recipe")
        for r, v in by.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ReportFieldError(f"{path}.by_recipe.{r}", f"{path}.by_recipe.{r}: expected a share, got {v!r}")
        return cls(module=_get(d, "module", path, (str,), "a module name"), type=_get(d, "type", path, (str,), "a type"),
                   reads={str(k): BlockCounts.from_dict(v, path=f"{path}.reads.{k}") for k, v in reads.items()},
                   loss=float(_get(d, "loss", path, (int, float), "a share")),
                   worst_read=_get(d, "worst_read", path, (str,), "a read"),
                   by_recipe={str(r): float(v) for r, v in by.items()})


@dataclass(frozen=True)
class BlockAdvice:
    """The per-layer answer for a scaled format: shares, the recipe to use, the layers to keep in bf16.

    ``recipe`` is the one judged, ``advised_recipe`` the one that keeps the most layers at or
    under ``threshold`` (a share of nonzero values), ``keep_high`` the layers that lose more
    than it under that recipe; ``citations`` the sources; ``delayed`` the delayed-scaling
    recipe when that is the advised one; ``note_codes`` the limits of the counts, as codes;
    ``hook_errors`` the tensors that could not be counted. The code to paste and the notes in
    words (:attr:`te_code`, :attr:`torchao_code`, :attr:`notes`) are rendered from this data
    in ``presentation.blockview``; ``stored`` holds the words a report file stored.
    """

    format: str
    recipe: str
    advised_recipe: str
    threshold: float
    layers: tuple[LayerLoss, ...]
    keep_high: tuple[str, ...]
    citations: tuple[Cited, ...] = ()  # records (fp16probe.sources); an older file's sentences as stored
    delayed: DelayedRecipe | None = None
    note_codes: tuple[str, ...] = ()
    hook_errors: int = 0
    stored: Mapping[str, Any] = field(default_factory=dict, compare=False)  # a file's notes

    # -- presentation (the words and the code, rendered on demand) --------------------
    @property
    def te_code(self) -> str:
        """TransformerEngine code for the advised recipe, written from the checked fields (a file's stored code is
        never shown: code comes from checked tokens only)."""
        from fp16probe.presentation.blockview import te_code

        return te_code(self)

    @property
    def torchao_code(self) -> str:
        """torchao code for the advised recipe, written from the checked fields (never a file's stored code)."""
        from fp16probe.presentation.blockview import torchao_code

        return torchao_code(self)

    @property
    def notes(self) -> tuple[str, ...]:
        """The limits of the counts in words (a file's stored notes as they were stored)."""
        from fp16probe.presentation.blockview import block_notes

        return tuple(self.stored.get("notes") or block_notes(self))

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (shares per layer and read, the advice and the code)."""
        return {
            "format": self.format, "recipe": self.recipe, "advised_recipe": self.advised_recipe,
            "threshold": self.threshold, "keep_high": list(self.keep_high),
            "layers": [layer.to_dict() for layer in self.layers],
            "te_code": self.te_code, "torchao_code": self.torchao_code, "notes": list(self.notes),
            "citations": [citation_to_json(c) for c in self.citations], "note_codes": list(self.note_codes),
            **({"delayed": self.delayed.to_dict()} if self.delayed is not None else {}),
            **({"hook_errors": self.hook_errors} if self.hook_errors else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "block_advice") -> "BlockAdvice":
        """Build from JSON; a bad field raises ReportFieldError naming it."""
        d = _obj(d, path)
        layers = d.get("layers", [])
        if not isinstance(layers, list):
            raise ReportFieldError(f"{path}.layers", f"{path}.layers: expected a list")
        fmt = _get(d, "format", path, (str,), "a format name")
        if fmt not in SCALED_FORMATS:  # the format and recipes become code to paste: known ones only
            raise ReportFieldError(f"{path}.format", f"{path}.format: expected one of {', '.join(SCALED_FORMATS)}, "
                                                     f"got {fmt[:40]!r}")
        recipes = SCALED_FORMATS[fmt].family.recipes
        for key in ("recipe", "advised_recipe"):
            if _get(d, key, path, (str,), "a recipe") not in recipes:
                raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected one of {', '.join(recipes)} for "
                                                        f"{fmt}, got {d[key][:40]!r}")
        return cls(
            format=fmt, recipe=d["recipe"], advised_recipe=d["advised_recipe"],
            threshold=float(_get(d, "threshold", path, (int, float), "a share")),
            layers=tuple(LayerLoss.from_dict(x, path=f"{path}.layers[{i}]") for i, x in enumerate(layers)),
            keep_high=_strings(d, "keep_high", path), citations=citations_from_json(d.get("citations", []), f"{path}.citations"),
            delayed=None if d.get("delayed") is None else _delayed(d["delayed"], f"{path}.delayed"),
            note_codes=_strings(d, "note_codes", path),
            hook_errors=int(_get(d, "hook_errors", path, (int,), "a count")) if "hook_errors" in d else 0,
            stored={"notes": _strings(d, "notes", path)},  # a stored te_code or torchao_code is not read
        )


def _delayed(d: Any, path: str) -> DelayedRecipe:
    d = _obj(d, path)
    try:
        return DelayedRecipe(int(d.get("history_len", 1024)), int(d.get("margin", 0)), str(d.get("algo", "max")))
    except (TypeError, ValueError) as e:
        raise ReportFieldError(path, f"{path}: not a delayed-scaling recipe ({e})") from None
