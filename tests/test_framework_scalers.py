"""The printed DeepSpeed and Megatron forms run in the installed frameworks (issue 41: a snippet per framework).

Each printed form is read by the framework's own config code (DeepSpeed's ``DeepSpeedFP16Config``,
Megatron-core's ``OptimizerConfig``), its scaler built as the framework builds it (DeepSpeed's
``CreateLossScaler``; Megatron-core's ``DynamicGradScaler`` with the arguments
``megatron.core.optimizer`` passes), stepped through overflow patterns by the framework's own update code,
and its scales compared with fp16probe's replay of the rule the form was written from. The schedule
replay's equality with these rules' transcriptions is tests/test_replay.py's; here the frameworks
themselves run. verl's form (ShardedGradScaler) runs in tests/test_rl_schedules.py.
"""

from __future__ import annotations

import json
import random
import shlex
import types

import pytest
import torch

from fp16probe.analysis.replay import ScalerRule, replay_scaler
from fp16probe.analysis.schedule import FRAMEWORK_RULES
from fp16probe.presentation.paste import deepspeed_fp16_block, megatron_flags

RULES = [rule for _, rule in FRAMEWORK_RULES] + [
    ScalerRule(),  # GradScaler's defaults: no floor
    ScalerRule(init_scale=2.0**10, growth_interval=3, hysteresis=3, min_scale=2.0),
    ScalerRule(init_scale=2.0**4, growth_interval=5),
]


def _patterns(rule: ScalerRule, n: int = 40) -> list[list[bool]]:
    """Random overflow patterns, and for long windows one long enough to grow three times (a short window
    would grow past float32's range over it, where the frameworks' number types part ways)."""
    rng = random.Random(5)
    made = [[rng.random() < rng.choice([0.05, 0.2, 0.5]) for _ in range(rng.randint(1, 120))] for _ in range(n)]
    return made + ([[False] * 1500 + [True, True, True] + [False] * 2100] if rule.growth_interval >= 500 else [])


def _expected(rule: ScalerRule, pattern: list[bool]) -> list[float]:
    replay = replay_scaler(pattern, **rule.to_dict())
    return list(replay.scales) + [replay.final_scale]


def _as_written(rule: ScalerRule, deepspeed: bool) -> ScalerRule:
    """The rule as the form writes it: a rule with no floor gets the frameworks' default floor, 1; DeepSpeed
    counts its window from the last overflow, Megatron from the last overflow or growth (the form's notes)."""
    return ScalerRule(**{**rule.to_dict(), "min_scale": rule.min_scale or 1.0, "deepspeed_window": deepspeed})


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.init_scale:g}-{r.growth_interval}-{r.hysteresis}")
def test_the_printed_deepspeed_block_runs_in_deepspeed_as_the_replay(rule, monkeypatch):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    block = json.loads(deepspeed_fp16_block(rule.to_dict()))["fp16"]
    config = DeepSpeedFP16Config(**block)  # DeepSpeed's own validation of the block
    # update_scale asks deepspeed.comm for the rank only to log an overflow: one process, rank 0
    monkeypatch.setattr(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    for pattern in _patterns(rule):
        scaler = loss_scaler.CreateLossScaler(torch.half, config.loss_scale, config.loss_scale == 0,
                                              config.dynamic_loss_scale_args())
        scaler.raise_error_at_min_scale = False  # its default stops the run at the floor; the replay keeps going
        scales = []
        for found_inf in pattern:
            scales.append(scaler.cur_scale)
            scaler.update_scale(found_inf)
        assert scales + [scaler.cur_scale] == _expected(_as_written(rule, True), pattern)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.init_scale:g}-{r.growth_interval}-{r.hysteresis}")
def test_the_printed_megatron_flags_run_in_megatron_core_as_the_replay(rule, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer import grad_scaler
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    words = shlex.split(megatron_flags(rule.to_dict()))
    assert words[0] == "--fp16"
    fields = {w[2:].replace("-", "_"): float(v) for w, v in zip(words[1::2], words[2::2])}
    config = OptimizerConfig(fp16=True, **fields)  # Megatron-LM's flags are these fields
    # DynamicGradScaler keeps its scale in CUDA tensors; on this CPU-only machine they are made on the CPU
    cpu_torch = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    cpu_torch.tensor = lambda data, dtype=None, device=None: torch.tensor(data, dtype=dtype)
    monkeypatch.setattr(grad_scaler, "torch", cpu_torch)
    for pattern in _patterns(rule):
        scaler = grad_scaler.DynamicGradScaler(  # as megatron.core.optimizer.get_megatron_optimizer builds it
            initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale, growth_factor=2.0,
            backoff_factor=0.5, growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
        scales = []
        for found_inf in pattern:
            scales.append(scaler.scale.item())
            scaler.update(found_inf)
        assert scales + [scaler.scale.item()] == _expected(_as_written(rule, False), pattern)
