"""What FP8 recipes, MXFP8 and NVFP4 lose, per layer, and the recipe to use: pure analysis of BlockStats.

Every share is computed from the captured statistics (:class:`fp16probe.blockscale.BlockStats`),
exactly: for power-of-two scales from the relative-exponent histogram, for per-tensor and
NVFP4 scales from counts made on the values themselves. A layer's loss is the largest share
of nonzero values flushed or saturated over its GEMM operands (input and weight read by the
forward GEMM along their rows; output gradient along rows for the input gradient, along
columns for the weight gradient; input and weight columns for the backward's transposed reads).

FP8 training scales each tensor (TransformerEngine, torchao): there is no global loss scale
and no GradScaler. Sources: Micikevicius et al., "FP8 Formats for Deep Learning", arXiv
2209.05433; OCP Microscaling Formats (MX) Specification v1.0; Rouhani et al., "Microscaling
Data Formats for Deep Learning", arXiv 2310.10537; Mishra et al., "Recipes for Pre-training
LLMs with MXFP8", arXiv 2506.08027; NVIDIA, "Pretraining Large Language Models with NVFP4",
arXiv 2509.25149.
"""

from __future__ import annotations

from collections.abc import Mapping

from collections.abc import Callable

from fp16probe.blockadvice import BlockAdvice, LayerLoss
from fp16probe.blockscale import BlockCounts, BlockStats, DelayedRecipe, TensorBlockStats, delayed_scales
from fp16probe.errors import AnalysisError
from fp16probe.formats import FAMILIES, SCALED_FORMATS, ElementFormat, Family, ScaledFormat, get_scaled
from fp16probe.sources import BLOCK_FORMATS as CITATIONS

__all__ = ["CITATIONS", "RECIPES", "THRESHOLDS", "BlockAdvice", "LayerLoss", "advise", "delayed_replay", "parse_recipe"]


# Recipes by family, the default (what TransformerEngine does out of the box) first: a view of the registry.
RECIPES: dict[str, tuple[str, ...]] = {name: f.recipes for name, f in FAMILIES.items()}

# Which operand reads are GEMM inputs: (kind, layout) pairs per family and recipe.
_FWD, _BWD_GRAD = ("input", "weight"), ("output_grad",)
_MX_READS = tuple((k, lay) for k in ("input", "weight", "output_grad") for lay in ("mx32", "mx32_t"))
_TILE_READS = (("input", "tile128"), ("input", "tile128_t"), ("weight", "tile128x128"),
               ("output_grad", "tile128"), ("output_grad", "tile128_t"))
_ROW_READS = (("input", "row"), ("weight", "row"), ("output_grad", "row"))


def parse_recipe(family: str | Family, text: str | None) -> tuple[str, DelayedRecipe | None]:
    """Read a ``--recipe`` value: one of the family's recipes, or for FP8
    ``delayed[:history_len[:margin[:max|most_recent]]]``. Return (name, delayed recipe or None)."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    if text is None:
        return fam.recipes[0], None
    name, _, rest = str(text).partition(":")
    if name not in fam.recipes:
        raise AnalysisError(f"recipe {text!r} does not apply here: expected one of {', '.join(fam.recipes)}"
                            + "".join(f" ({p} takes :history_len:margin:algo)" for p in fam.parametrised))
    if name not in fam.parametrised:
        if rest:
            raise AnalysisError(f"recipe {text!r}: only delayed takes parameters")
        return name, None
    parts = rest.split(":") if rest else []
    try:
        hist = int(parts[0]) if len(parts) > 0 and parts[0] else 1024
        margin = int(parts[1]) if len(parts) > 1 and parts[1] else 0
        algo = parts[2] if len(parts) > 2 and parts[2] else "max"
        if len(parts) > 3:
            raise ValueError("too many fields")
        return name, DelayedRecipe(hist, margin, algo)
    except ValueError as e:
        raise AnalysisError(f"recipe {text!r}: expected delayed:history_len:margin:algo, e.g. delayed:1024:0:max "
                            f"({e})") from None


Reads = Callable[[TensorBlockStats, ElementFormat, str, "DelayedRecipe | None"], dict[str, BlockCounts]]
_GEMM_KINDS = ("input", "weight", "output_grad")


def _mx_reads(t: TensorBlockStats, el: ElementFormat, recipe: str, delayed: DelayedRecipe | None) -> dict[str, BlockCounts]:
    """MX: 1x32 blocks along rows and columns, under the scale rule ``recipe``."""
    return {f"{kind}/{'rows' if lay == 'mx32' else 'columns'}": t.counts(lay, el.name, recipe)
            for kind, lay in _MX_READS if kind == t.kind and lay in t.relative}


def _fp8_reads(t: TensorBlockStats, el: ElementFormat, recipe: str, delayed: DelayedRecipe | None) -> dict[str, BlockCounts]:
    """FP8: one scale per tensor (current or delayed), per row, or per 128 tile."""
    out: dict[str, BlockCounts] = {}
    if t.kind not in _GEMM_KINDS:
        return out
    if recipe == "current" and el.name in t.current:
        out[f"{t.kind}/tensor"] = t.current[el.name]
    elif recipe == "delayed":
        want = delayed or DelayedRecipe()
        for r, e, c in t.delayed:
            if r == want and e == el.name:
                out[f"{t.kind}/tensor"] = c
    else:  # (also "current" for an element not counted per tensor, as before the registry)
        reads = _ROW_READS if recipe == "rowwise" else _TILE_READS
        for kind, lay in reads:
            if kind == t.kind and lay in t.relative:
                out[f"{kind}/{lay}"] = t.counts(lay, el.name, "pow2")
    return out


_NV_ROWS = {"torchao": "1x16", "cast": "1x16_cast", "16x16": "1x16"}
_NV_COLS = {"torchao": "1x16_t", "cast": "1x16_cast_t", "16x16": "1x16_t"}


def _nvfp4_reads(t: TensorBlockStats, el: ElementFormat, recipe: str, delayed: DelayedRecipe | None) -> dict[str, BlockCounts]:
    """NVFP4: 1x16 blocks along rows and columns (16x16 blocks for the weight under the 16x16 recipe)."""
    out: dict[str, BlockCounts] = {}
    if t.kind not in _GEMM_KINDS:
        return out
    square = recipe == "16x16" and t.kind == "weight"
    rows, cols = ("16x16", "16x16") if square else (_NV_ROWS[recipe], _NV_COLS[recipe])
    for variant, where in ((rows, "rows"), (cols, "columns")):
        if variant in t.nvfp4:  # (reports made before the columns were counted have rows only)
            out[f"{t.kind}/{where if variant != '16x16' else '16x16'}"] = t.nvfp4[variant]
    return out


# Which operand reads each family's GEMMs make, one function per family (a new family: one function, one entry).
READS: dict[str, Reads] = {"fp8": _fp8_reads, "mx": _mx_reads, "nvfp4": _nvfp4_reads}


def _reads(t: TensorBlockStats, fmt: ScaledFormat, recipe: str, delayed: DelayedRecipe | None) -> dict[str, BlockCounts]:
    """The counts of each read of one tensor under one recipe ({} when the recipe reads it not)."""
    return READS[fmt.family.name](t, fmt.element_for(t.kind), recipe, delayed)


def _loss(reads: Mapping[str, BlockCounts]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k, c in reads.items():
        share = (c.flushed + c.saturated) / c.nonzero if c.nonzero else 0.0
        if share > worst or not where:
            worst, where = share, k
    return worst, where


def _layers(stats: BlockStats, fmt: ScaledFormat, recipe: str,
            delayed: DelayedRecipe | None) -> dict[str, tuple[str, dict[str, BlockCounts]]]:
    layers: dict[str, tuple[str, dict[str, BlockCounts]]] = {}
    for t in stats.tensors:
        entry = layers.setdefault(t.module, (t.type, {}))
        entry[1].update(_reads(t, fmt, recipe, delayed))
    return layers


# The loss a layer may take, per family (see :data:`fp16probe.formats.FAMILIES`): a view of the registry.
THRESHOLDS = {name: f.threshold for name, f in FAMILIES.items()}


def advise(stats: BlockStats, format: str | ScaledFormat, recipe: str | None = None, *,
           threshold: float | None = None) -> BlockAdvice:
    """Per layer, what ``format`` loses under ``recipe`` (default: TE's), which recipe keeps every layer's
    loss at or under ``threshold`` (a share of nonzero values; default: the family's), and which
    layers to keep in bf16."""
    fmt = get_scaled(format)
    if fmt is None:
        raise AnalysisError(f"format {format!r} is not a scaled format: expected one of {', '.join(SCALED_FORMATS)}")
    format, family = fmt.name, fmt.family.name
    if family not in stats.families:
        raise AnalysisError(f"this report's block statistics cover {', '.join(stats.families) or 'nothing'}, "
                            f"not {family}: profile again with --format {format}")
    name, delayed = parse_recipe(fmt.family, recipe)
    if threshold is None:
        threshold = fmt.family.threshold
    candidates = list(fmt.family.recipes)
    per_recipe = {r: _layers(stats, fmt, r, delayed if r == "delayed" else None) for r in candidates}
    if delayed is not None and not any(rc == delayed for t in stats.tensors for rc, _, _ in t.delayed):
        raise AnalysisError(f"delayed scaling {delayed.to_dict()} was not captured live; profile with "
                            f"--recipe delayed:{delayed.history_len}:{delayed.margin}:{delayed.algo}")
    chosen = per_recipe[name]
    layers = []
    for module, (type_name, reads) in chosen.items():
        if not reads:
            continue
        loss, worst = _loss(reads)
        by = {r: _loss(per_recipe[r].get(module, ("", {}))[1])[0] for r in candidates}
        layers.append(LayerLoss(module, type_name, reads, loss, worst, by))
    over = {r: sum(1 for layer in layers if layer.by_recipe[r] > threshold) for r in candidates}
    advised = min(candidates, key=lambda r: (over[r], candidates.index(r)))
    if recipe is not None and over[name] <= over[advised]:
        advised = name
    keep = tuple(layer.module for layer in layers if layer.by_recipe[advised] > threshold)
    notes = ["shares_of_nonzero", "not_modelled"]  # worded in presentation.blockview
    if family == "fp8":
        notes += ["fp8_per_tensor", "delayed_first_step"]
    if any(layer.type == "Conv1D" for layer in layers):
        notes.append("conv1d")
    if family == "nvfp4":
        notes.append("nvfp4_threshold")
        if any(c.blocks_lost for layer in layers for c in layer.reads.values()):
            notes.append("blocks_lost")
    if stats.hook_errors:
        notes.append("hook_errors")
    return BlockAdvice(format, name, advised, threshold, tuple(layers), keep, CITATIONS,
                       delayed=delayed if advised == "delayed" else None, note_codes=tuple(notes),
                       hook_errors=stats.hook_errors)


def delayed_replay(t: TensorBlockStats, element: str, recipe: DelayedRecipe) -> tuple[list[float], list[int]]:
    """Replay TE's delayed scaling over a tensor's amax trace: the scale of each step, and the steps whose
    amax exceeds what that scale can hold (some values saturate there)."""
    from fp16probe.formats import ELEMENTS

    scales = delayed_scales(t.amax_trace, element, history_len=recipe.history_len, margin=recipe.margin,
                            algo=recipe.algo)
    limit = ELEMENTS[element].overflow
    hot = [i for i, (a, s) in enumerate(zip(t.amax_trace, scales)) if a * s > limit]
    return scales, hot
