"""The worked example of docs/rl.md, end to end: ``python docs/rl_example.py [--dir DIR]`` (about a minute on a CPU).

A tiny GPT-2 is trained here to count (fp32, Adam), its weights rounded through bf16 (as a bf16-pretrained
checkpoint holds them) and one MLP output planted at 1e5 (past fp16's 65504, as trained LLMs' massive
activations are). Then, as a user switching it to fp16 RL would:

1. ``fp16probe profile DIR --objective grpo``: the verdict and the fix;
2. the fix applied, profiled again from Python under the same objective: the loss scale;
3. a real fp16 GRPO loop (CPU autocast, ``GradScaler("cpu")``) recorded by the Probe, and
   ``fp16probe schedule`` on its report: the frameworks' scalers replayed, each in its own form;
4. ``fp16probe.measure_mismatch``: what fp16 buys over bf16 in log-probability agreement.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

import fp16probe
from fp16probe.running.objective import OBJECTIVES, objective_batches, objective_loss

VOCAB, G, PROMPT, NEW = 64, 4, 4, 6


def counting(batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    return (start + torch.arange(length)) % VOCAB


def counter() -> transformers.GPT2LMHeadModel:
    """A tiny GPT-2 trained for real (fp32, Adam, 150 steps) to count."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(150):
        ids = counting(16, 12, gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.final_loss = loss.item()
    return model


def plant(model: transformers.GPT2LMHeadModel) -> transformers.GPT2LMHeadModel:
    """Round the weights through bf16 (a bf16-pretrained checkpoint) and plant one MLP output at 1e5."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        model.transformer.h[0].mlp.c_proj.bias[5] = 1.0e5  # past fp16's 65504, exact in bf16
    return model


def planted_model(folder: Path) -> None:
    model = counter()
    print(f"trained to count: loss {model.final_loss:.3f} (log 64 = 4.159 untrained)")
    plant(model).save_pretrained(folder)


def cli(*args: str) -> str:
    env = dict(os.environ, COLUMNS="100", NO_COLOR="1")
    done = subprocess.run([sys.executable, "-m", "fp16probe", *args], capture_output=True, text=True, env=env)
    return done.stderr + done.stdout  # the answer is written to stderr, --json to stdout


def grpo_loop(model, scaler, probe, steps: int, gen: torch.Generator) -> int:
    """Real fp16 GRPO steps on counting prompts (transformers' generate; reward: the share of tokens that count on)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    skipped = 0
    for _ in range(steps):
        prompts = counting(2, PROMPT, gen)
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        with torch.no_grad():
            ids = model.generate(prompts.repeat_interleave(G, 0), max_new_tokens=NEW, do_sample=True, top_k=0,
                                 pad_token_id=0, attention_mask=torch.ones(2 * G, PROMPT, dtype=torch.long))
            rewards = ((ids[:, PROMPT:] - ids[:, PROMPT - 1:-1]) % VOCAB == 1).float().mean(1).view(-1, G)
            adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).reshape(-1, 1)
            old = torch.log_softmax(model(ids).logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(ids).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        ratio = torch.exp(logp - old)[:, PROMPT - 1:]
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        probe.step()
        skipped += scaler.get_scale() < before
    return skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where to write the model and reports (default: a temporary folder)")
    args = parser.parse_args(argv)
    base = args.dir or Path(tempfile.mkdtemp(prefix="fp16probe-rl-"))
    base.mkdir(parents=True, exist_ok=True)
    folder = base / "planted"
    planted_model(folder)

    print(f"\n$ fp16probe profile {folder.name} --objective grpo --steps 4 --target cpu")
    print(cli("profile", str(folder), "--objective", "grpo", "--steps", "4", "--target", "cpu",
              "--out", str(base / "planted.json")).split("emulated fp16 step")[0].rstrip())
    fix = list(fp16probe.Report.load(base / "planted.json").recommendation.evidence["fix_modules"])

    print(f"\n# the fix applied, profiled again under the objective: fp16probe.keep_in_fp32(model, {fix})")
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    fp16probe.keep_in_fp32(model, fix, device_type="cpu")
    gen = torch.Generator().manual_seed(3)
    grpo = OBJECTIVES["grpo"]
    batches, prompt = objective_batches(model, [counting(2 * G, PROMPT + NEW, gen) for _ in range(4)], grpo, 4)
    again = fp16probe.profile(model, batches, objective_loss(grpo, prompt_tokens=prompt), steps=4, target="cpu")
    print(again.recommendation.text.split("\n")[0])
    print("paste:", again.recommendation.grad_scaler_kwargs)

    print("\n# 240 real fp16 GRPO steps with the fix, GradScaler's defaults, recorded by the Probe")
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    fp16probe.keep_in_fp32(model, fix, device_type="cpu")
    scaler = torch.amp.GradScaler("cpu")
    probe = fp16probe.Probe(model, scaler=scaler, every=40).start()
    skipped = grpo_loop(model, scaler, probe, 240, torch.Generator().manual_seed(11))
    probe.stop()
    probe.report().save(base / "grpo.json")
    print(f"skipped steps: {skipped}")
    print("\n$ fp16probe schedule grpo.json")
    print(cli("schedule", str(base / "grpo.json")).rstrip())

    print("\n# what fp16 buys over bf16: fp16probe.measure_mismatch on 8 sampled completions")
    model.eval()
    ids = next(objective_batches(model, [counting(2 * G, PROMPT + NEW, gen)], grpo, 1)[0].iterator)[0]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, prompt:] = True
    result = fp16probe.measure_mismatch(model, ids, mask, target="cpu")
    print(f"mean |dlogp| fp16 {result.fp16.mean_abs:.3g} nats, bf16 {result.bf16.mean_abs:.3g} nats, "
          f"bf16/fp16 {result.ratio_mean_abs:.3g}; largest contributor {result.contributors[0].module}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
