"""The scaled-format answer as plain lines: per-layer shares, the recipe, the layers to keep, the code.

Reads a :class:`fp16probe.blockadvice.BlockAdvice` (fresh, or a saved report's section), so
that a saved report shows the same table; no rich here (the terminal module prints it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fp16probe.blockadvice import BlockAdvice
from fp16probe.blockscale import DelayedRecipe
from fp16probe.formats import SCALED_FORMATS
from fp16probe.formatting import percent
from fp16probe.presentation.answer import stacked_table, wrap_text
from fp16probe.presentation.cite import cite

__all__ = ["NOTE_WORDS", "RECIPE_WORDS", "block_advice_lines", "block_notes", "te_code", "torchao_code"]

RECIPE_WORDS = {
    "current": "per-tensor current scaling (TE Float8CurrentScaling, torchao tensorwise)",
    "delayed": "delayed scaling (TE DelayedScaling)",
    "rowwise": "rowwise power-of-two scales (torchao rowwise)",
    "blockwise": "1x128 / 128x128 power-of-two tiles (TE Float8BlockScaling)",
    "rceil": "E8M0 scales rounded up (RCEIL: TE MXFP8BlockScaling, cuBLAS)",
    "floor": "E8M0 scales by the OCP MX v1.0 rule (FLOOR)",
    "ceil": "E8M0 scales, torchao CEIL",
    "even": "E8M0 scales, torchao EVEN",
    "torchao": "1x16 E2M1 blocks, E4M3 block scales clamped at 2^-6 (torchao)",
    "cast": "1x16 E2M1 blocks, E4M3 block scales cast as they are (a block scale can flush)",
    "16x16": "1x16 blocks, 16x16 weight tiles (the NVFP4 paper's weights)",
}


def _row(layer: Mapping[str, Any], recipes: list[str]) -> list[str]:
    read = layer["reads"].get(layer["worst_read"], {})
    return [layer["module"], layer["type"], layer["worst_read"], percent(read.get("flushed_share", 0.0)),
            percent(read.get("subnormal", 0) / read["nonzero"] if read.get("nonzero") else 0.0),
            percent(read.get("saturated_share", 0.0))] + [percent(layer["by_recipe"][r]) for r in recipes]


def _table(advice: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    recipes = list(next(iter(advice["layers"]), {}).get("by_recipe", {}))
    head = ["layer", "type", "worst read", "flushed", "subnormal", "saturated"] + [f"lost: {r}" for r in recipes]
    return head, [_row(layer, recipes) for layer in advice["layers"]]


def block_advice_lines(block_advice: BlockAdvice, *, top: int | None = None, width: int | None = None) -> list[str]:
    """Return the answer for one scaled format as text lines (the table aligned with spaces).

    With ``width``, sentences are wrapped to it and a table wider than it is stacked: each
    layer's name, type and worst read on a line, its shares under short headers below.
    """
    advice = block_advice.to_dict()  # its JSON form carries each read's shares
    head, rows = _table(advice)
    shown = sorted(rows, key=lambda r: -max(float(c.rstrip("%")) for c in r[6:])) if top else rows
    shown = shown[:top] if top else shown
    widths = [max(len(str(c)) for c in col) for col in zip(head, *shown)] if shown else [len(h) for h in head]
    fmt, recipe = advice["format"], advice["recipe"]
    out = [f"{fmt} under {recipe}: {RECIPE_WORDS.get(recipe, recipe)}",
           "per layer, the GEMM read that loses most: shares of its nonzero values; lost = flushed + saturated"]
    if width is None or sum(widths) + 2 * (len(widths) - 1) <= width:
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in shown]
    else:
        short = ["flushed", "subn", "sat"] + list(next(iter(advice["layers"]), {}).get("by_recipe", {}))
        legend = [("subn", "subnormal"), ("sat", "saturated")] + ([(
            ", ".join(short[3:]), "lost under each recipe")] if short[3:] else [])
        out += stacked_table(["layer (type, worst read)", *short],
                             [[f"{r[0]} ({r[1]}, {r[2]})", *r[3:]] for r in shown], width, legend)
    thr = percent(advice["threshold"])
    advised = advice["advised_recipe"]
    keep = advice["keep_high"]
    if not keep:
        out.append(f"advice: {advised} keeps every layer's loss at or under {thr}")
    else:
        out.append(f"advice: {advised}; {len(keep)} layer(s) lose more than {thr} under every recipe "
                   f"here: keep them in bf16: {', '.join(keep)}")
    out += ["TransformerEngine:"] + ["  " + line for line in advice["te_code"].splitlines()]
    out += ["torchao:"] + ["  " + line for line in advice["torchao_code"].splitlines()]
    out += [f"note: {n}" for n in advice["notes"]]
    out += ["sources:"] + [f"- {cite(c)}" for c in block_advice.citations]
    if width is None:
        return out
    code = {"  " + line for key in ("te_code", "torchao_code") for line in advice[key].splitlines()}
    return [piece for line in out for piece in ([line] if line in code else wrap_text(line, width, "  "))]


# The limits of the counts (BlockAdvice.note_codes), in words.
NOTE_WORDS: dict[str, Callable[[BlockAdvice], str]] = {
    "shares_of_nonzero": lambda a: "shares are of nonzero values; TransformerEngine's underflows% divides by all "
                                   "elements, zeros included",
    "not_modelled": lambda a: "not modelled: accumulation inside the GEMM kernels, and the random Hadamard transform "
                              "NVFP4 applies to some GEMM inputs",
    "fp8_per_tensor": lambda a: "FP8 scales each tensor (no global loss scale: no GradScaler)",
    "delayed_first_step": lambda a: "delayed scaling casts the first step with TE's initial scale 1.0 (counted here, "
                                    "as TE does); later steps use the amax window",
    "conv1d": lambda a: "Conv1D layers (GPT-2 in transformers) are not nn.Linear: TransformerEngine and torchao "
                        "convert nn.Linear only; the shares are those the layer has as a Linear",
    "nvfp4_threshold": lambda a: f"threshold {percent(a.threshold)}: E2M1 flushes values more than 4.6 binades below "
                                 "their block's max, about 6-7% of a Gaussian block of 16 by design",
    "blocks_lost": lambda a: "some blocks lose every value: their E4M3 block scale flushes",
    "hook_errors": lambda a: f"{a.hook_errors} tensor(s) could not be counted (hook errors)",
}


def block_notes(advice: BlockAdvice) -> tuple[str, ...]:
    """The limits of the counts in words, one per note code (an unknown code as itself)."""
    return tuple(NOTE_WORDS[c](advice) if c in NOTE_WORDS else c for c in advice.note_codes)


_UNKNOWN = "# no code: the advice's format or recipe is not one fp16probe knows"


def _known(advice: BlockAdvice) -> bool:
    """Whether the format and recipe that go into the code are known ones (a report's are checked as it loads)."""
    fmt = SCALED_FORMATS.get(advice.format)
    return fmt is not None and advice.advised_recipe in fmt.family.recipes


def te_code(advice: BlockAdvice) -> str:
    """TransformerEngine code for the advised recipe: the recipe object and the modules to keep in bf16."""
    format, recipe, keep, delayed = advice.format, advice.advised_recipe, advice.keep_high, advice.delayed
    if not _known(advice):
        return _UNKNOWN
    fmt = "Format.HYBRID" if SCALED_FORMATS[format].element.name == "e5m2" else "Format.E4M3"
    family = SCALED_FORMATS[format].family.name
    if family == "fp8":
        if recipe == "delayed":
            d = delayed or DelayedRecipe()
            obj = (f"DelayedScaling(\n    fp8_format={fmt}, amax_history_len={d.history_len}, margin={d.margin},\n"
                   f'    amax_compute_algo="{d.algo}")')
            name = "DelayedScaling"
        elif recipe == "blockwise":
            obj, name = "Float8BlockScaling()", "Float8BlockScaling"
        elif recipe == "rowwise":
            return "# TransformerEngine has no rowwise FP8 recipe: use torchao's (below)"
        else:
            obj, name = f"Float8CurrentScaling(fp8_format={fmt})", "Float8CurrentScaling"
    elif family == "mx":
        if recipe != "rceil":
            return f"# TransformerEngine's MXFP8BlockScaling rounds scales up (RCEIL); for {recipe}, use torchao (below)"
        obj, name = f"MXFP8BlockScaling(fp8_format={fmt})", "MXFP8BlockScaling"
    else:
        obj, name = "NVFP4BlockScaling()", "NVFP4BlockScaling"
    imports = f"from transformer_engine.common.recipe import {'Format, ' if 'Format.' in obj else ''}{name}"
    lines = ["import transformer_engine.pytorch as te", imports, f"recipe = {obj}"]
    if keep:
        lines.append("# keep in bf16 (build them as torch.nn.Linear, not te.Linear):")
        lines += [f"#   {name!r}" for name in keep]  # a name's repr: one line, whatever it holds
    lines += ["with te.fp8_autocast(enabled=True, fp8_recipe=recipe):", "    loss = model(batch)"]
    return "\n".join(lines)


def torchao_code(advice: BlockAdvice) -> str:
    """torchao code for the advised recipe, leaving the layers to keep in high precision."""
    format, recipe, keep = advice.format, advice.advised_recipe, advice.keep_high
    if not _known(advice):
        return _UNKNOWN
    family = SCALED_FORMATS[format].family.name
    # One name a line: the code stays within 80 columns however many layers are kept.
    keep_line = ("KEEP = {\n" + "".join(f"    {name!r},\n" for name in sorted(set(keep))) + "}") if keep else "KEEP = set()"
    keep_fn = ["def fp8_linear(m, fqn):", "    return isinstance(m, torch.nn.Linear) and fqn not in KEEP"]
    if family == "fp8":
        if recipe in ("delayed", "blockwise"):
            return f"# torchao's float8 training has no {recipe} recipe: use TransformerEngine's (above)"
        name = "rowwise" if recipe == "rowwise" else "tensorwise"
        return "\n".join([
            "from torchao.float8 import Float8LinearConfig, convert_to_float8_training",
            keep_line,
            f'config = Float8LinearConfig.from_recipe_name("{name}")',
            "convert_to_float8_training(",
            "    model, config=config, module_filter_fn=lambda m, fqn: fqn not in KEEP)",
        ])
    if family == "mx":
        return "\n".join([
            "import torch",
            "from torchao.quantization import quantize_",
            "from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig",
            "from torchao.prototype.mx_formats.config import ScaleCalculationMode",
            keep_line,
            f"config = MXFP8TrainingOpConfig(\n    scale_calculation_mode=ScaleCalculationMode.{recipe.upper()})",
            *keep_fn,
            "quantize_(model, config, filter_fn=fp8_linear)",
        ])
    return "\n".join([
        "import torch",
        "from torchao.quantization import quantize_",
        "from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import (",
        "    NVFP4TrainingConfig)",
        keep_line,
        *keep_fn,
        "quantize_(model, NVFP4TrainingConfig(), filter_fn=fp8_linear)",
    ])
