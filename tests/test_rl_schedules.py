"""The RL frameworks' loss-scaling settings (issue 41, item 2): replayed on a run's history, written in each framework's form.

The real run is written here with plain torch: a tiny causal LM trained by a GRPO-style loss
(group-normalised advantages from seeded synthetic rewards, token log-probs, a clipped ratio;
Shao et al., arXiv 2402.03300) under CPU fp16 autocast and a real ``torch.amp.GradScaler("cpu")``,
once with verl's ``growth_interval=400`` and once with GradScaler's defaults. Overflows happen in
both (a wide output layer), and the 400-step interval grows the scale once inside the run.
"""

from __future__ import annotations

import ast
import inspect
import json
import shlex

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fp16probe import Probe
from fp16probe.analysis.replay import ScalerRule
from fp16probe.analysis.schedule import DEFAULTS, FRAMEWORK_RULES, OWN, judge_schedules
from fp16probe.formats import get_format
from fp16probe.presentation.paste import (deepspeed_fp16_block, framework_settings, megatron_flags,
                                          sharded_grad_scaler_call)
from fp16probe.presentation.schedule import framework_snippets, schedule_dict

STEPS = 480
VERL = "verl (interval 400)"

# The documented option names, copied from each framework's documentation (golden data).
# DeepSpeed: https://www.deepspeed.ai/docs/config-json/#fp16-training-options
DEEPSPEED_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                       "hysteresis", "consecutive_hysteresis", "min_loss_scale"}
# Megatron-LM: megatron/training/arguments.py (_add_mixed_precision_args),
# https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/training/arguments.py
MEGATRON_FLAGS = {"--fp16", "--bf16", "--loss-scale", "--initial-loss-scale", "--min-loss-scale",
                  "--loss-scale-window", "--hysteresis"}
# torch: https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (ShardedGradScaler)
SHARDED_GRAD_SCALER_ARGS = {"device", "init_scale", "backoff_factor", "growth_factor", "growth_interval",
                            "enabled", "process_group"}


def _grpo_run(growth_interval: int | None, steps: int = STEPS):
    torch.manual_seed(0)
    vocab, hidden, length, group, prompts = 32, 16, 8, 8, 2
    model = nn.Sequential(nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, vocab))
    with torch.no_grad():
        model[3].weight.mul_(5.0)  # wide logits: backward's fp16 activation gradients pass 65504 at times
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", **({} if growth_interval is None else {"growth_interval": growth_interval}))
    probe = Probe(model, scaler=scaler, every=40).start()
    g = torch.Generator().manual_seed(1)
    skipped = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (prompts * group, length + 1), generator=g)
        rewards = torch.rand(prompts, group, generator=g) ** 3
        adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens[:, :-1])
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=g)  # a behaviour policy a little off
        ratio = torch.exp(logp - old)
        a = adv.reshape(-1, 1)
        loss = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a).sum()
        scaler.scale(loss).backward()
        s = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < s)  # GradScaler backs off exactly on a skipped step
        opt.zero_grad()
        probe.step()
    probe.stop()
    return probe.report(), sum(skipped)


@pytest.fixture(scope="module")
def runs():
    return {"verl": _grpo_run(400), "defaults": _grpo_run(None, 240)}  # 400 grows once within 480 steps


def test_predicted_skipped_steps_equal_the_real_runs(runs):
    fp16 = get_format("fp16")
    verl_report, verl_skipped = runs["verl"]
    defaults_report, defaults_skipped = runs["defaults"]
    assert verl_skipped >= 1 and defaults_skipped >= 1 and verl_skipped != defaults_skipped
    verl_table = judge_schedules(verl_report, fp16)
    defaults_table = judge_schedules(defaults_report, fp16)
    assert verl_table.reproduced and defaults_table.reproduced
    assert verl_table.row(VERL).skipped_steps == verl_skipped
    assert verl_table.row(OWN).skipped_steps == verl_skipped
    assert defaults_table.row(DEFAULTS).skipped_steps == defaults_skipped
    assert dict(FRAMEWORK_RULES)[VERL] == ScalerRule(growth_interval=400)
    d = schedule_dict(verl_table)
    assert d["frameworks"]["rule"] == d["best"]


def test_framework_forms_use_the_documented_names_and_parse():
    for _, rule in FRAMEWORK_RULES:
        r = rule.to_dict()
        block = deepspeed_fp16_block(r)
        assert block is not None
        fp16 = json.loads(block)["fp16"]
        assert set(fp16) <= DEEPSPEED_FP16_KEYS and fp16["loss_scale"] == 0
        assert 2.0 ** fp16["initial_scale_power"] == rule.init_scale
        assert (fp16["loss_scale_window"], fp16["hysteresis"], fp16["min_loss_scale"]) == (
            rule.growth_interval, rule.hysteresis, rule.min_scale or 1)  # DeepSpeed needs a floor above 0
        words = shlex.split(megatron_flags(r) or "")
        flags = [w for w in words if w.startswith("--")]
        assert set(flags) <= MEGATRON_FLAGS and "--fp16" in flags
        values = dict(zip(words[1::2], map(float, words[2::2])))
        assert values == {"--initial-loss-scale": rule.init_scale, "--loss-scale-window": rule.growth_interval,
                          "--hysteresis": rule.hysteresis, "--min-loss-scale": rule.min_scale or 1}
    # hysteresis and a floor cannot be written for GradScaler or ShardedGradScaler; other factors not for DeepSpeed
    megatron = dict(FRAMEWORK_RULES)["Megatron (hysteresis 2)"].to_dict()
    assert sharded_grad_scaler_call(megatron) is None and framework_settings(megatron, "torch") is None
    x4 = ScalerRule(growth_factor=4.0).to_dict()
    assert deepspeed_fp16_block(x4) is None and megatron_flags(x4) is None
    assert deepspeed_fp16_block(ScalerRule(init_scale=3000.0).to_dict()) is None


def _sharded_kwargs(line: str) -> dict[str, float]:
    tree = ast.parse(line)
    call = tree.body[-1].value  # type: ignore[attr-defined]
    assert call.func.id == "ShardedGradScaler"
    # the values are number literals or powers of two (2.0**16): evaluated with no names in scope
    return {k.arg: eval(compile(ast.Expression(k.value), "<line>", "eval"), {"__builtins__": {}})
            for k in call.keywords}


def test_the_printed_sharded_grad_scaler_line_builds_one_that_steps_as_the_replay(tmp_path):
    rule = dict(FRAMEWORK_RULES)[VERL]
    line = sharded_grad_scaler_call(rule.to_dict())
    assert line is not None and line.startswith("from torch.distributed.fsdp.sharded_grad_scaler import")
    kwargs = _sharded_kwargs(line)
    assert set(kwargs) <= SHARDED_GRAD_SCALER_ARGS <= set(inspect.signature(ShardedGradScaler).parameters)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        scales = _step_sharded(ShardedGradScaler("cpu", **kwargs))
    finally:
        dist.destroy_process_group()
    # one backoff at step 10, then growth every 400 clean steps: what verl's rule replays
    assert scales[10] == 2.0**15 and scales[410] == 2.0**16 and scales[810] == 2.0**17
    assert scales[409] == 2.0**15 and scales[809] == 2.0**16


def _step_sharded(scaler: ShardedGradScaler) -> list[float]:
    p = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for step in range(900):
        scaler.scale(p.sum() * (float("inf") if step == 10 else 1.0)).backward()  # an overflow at step 10
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return scales


def test_every_framework_gets_a_form_or_a_reason():
    rule = ScalerRule(growth_interval=400).to_dict()
    assert all(framework_settings(rule, fw) is not None for fw in ("torch", "verl", "deepspeed", "megatron"))


@pytest.mark.parametrize("fine", [False, True])
def test_the_snippets_follow_the_advised_rule(runs, fine):
    """The best rule, or GradScaler's defaults where the table finds them already fine (as the answer says):
    never a rule the answer advises against."""
    import dataclasses

    table = dataclasses.replace(judge_schedules(runs["defaults"][0], get_format("fp16")), defaults_fine=fine)
    snippets = framework_snippets(table)
    advised = table.rows[0] if fine else table.row(table.best)
    assert table.rows[0].name == DEFAULTS and (fine or table.best != DEFAULTS)
    for fw, text in snippets["settings"].items():
        assert text == framework_settings(advised.rule, fw)
        assert (text is None) == (fw in snippets["cannot"])
