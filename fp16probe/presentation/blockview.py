"""The scaled-format answer as plain lines: per-layer shares, the recipe, the layers to keep, the code.

Reads the ``block_advice`` JSON (:meth:`fp16probe.analysis.blockformats.BlockAdvice.to_dict`)
so that a saved report shows the same table; no rich here (the terminal module prints it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp16probe.formatting import percent
from fp16probe.presentation.answer import stacked_table, wrap_text

__all__ = ["RECIPE_WORDS", "block_advice_lines"]

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


def block_advice_lines(advice: Mapping[str, Any], *, top: int | None = None, width: int | None = None) -> list[str]:
    """Return the answer for one scaled format as text lines (the table aligned with spaces).

    With ``width``, sentences are wrapped to it and a table wider than it is stacked: each
    layer's name, type and worst read on a line, its shares under short headers below.
    """
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
    out.append("sources: " + "; ".join(advice["citations"]))
    if width is None:
        return out
    code = {"  " + line for key in ("te_code", "torchao_code") for line in advice[key].splitlines()}
    return [piece for line in out for piece in ([line] if line in code else wrap_text(line, width, "  "))]
