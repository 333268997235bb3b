"""An RL objective for a profile: completions sampled from the model, and the policy-gradient loss on them.

``profile FOLDER --objective grpo`` (or ``ppo``) profiles the step an RL post-training framework takes
instead of next-token cross-entropy. Before the run, with the model as loaded (fp32, eval mode, no
gradients, the probe not attached), each batch's first ``prompt_tokens`` token ids are a prompt; every
prompt is sampled ``group_size`` times to the batch's sequence length (plain ancestral sampling at
temperature 1 from a seeded generator; no KV cache, no stop token). The sampling policy's per-token
log-probabilities, taken then in fp32, are both the rollout's ``logp_old`` and the reference's (the
model before its first update, as at the start of RL). Rewards are synthetic unless given: a seeded
uniform score per token id, averaged over the completion, which no model earns on purpose; they only
make advantages of both signs and realistic size.

A batch is the tuple ``(input_ids, logp_old, ref_logp, advantages)``; the model is fed ``input_ids``
(the first element, by :func:`fp16probe.running.inputs.call_model`'s rule) and the loss reads the rest,
so the emulated step, ``--verify`` and ``--trial`` rerun exactly the same objective. The loss terms are
:mod:`fp16probe.running.rl`'s (verl's): GRPO's group advantages, the clipped ratio, the k3 KL with
weight ``beta``, an entropy bonus, token-mean aggregation.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fp16probe.errors import InputError
from fp16probe.running.inputs import Batches
from fp16probe.running.losses import Loss
from fp16probe.running.rl import AGGREGATIONS, advantages, policy_loss, token_logprobs

__all__ = ["OBJECTIVES", "Objective", "objective_batches", "objective_loss", "rollout_batch", "rollout_batches",
           "sampled_batch"]


@dataclass(frozen=True)
class Objective:
    """An RL objective's settings. ``group=True`` is GRPO (advantages normalised within each prompt's group);
    ``group=False`` is PPO without a critic (the batch's mean reward as the baseline)."""

    name: str
    group: bool
    group_size: int = 4
    prompt_tokens: int | None = None  # default: half of each sequence (all of it with new_tokens)
    new_tokens: int | None = None  # default: the rest of each sequence after the prompt
    clip_eps: float = 0.2
    beta: float = 0.0  # weight of the k3 KL to the reference
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise InputError(f"group_size={self.group_size}: expected 2 or more completions per prompt",
                             parameter="objective")
        if self.aggregation not in AGGREGATIONS:
            raise InputError(f"aggregation={self.aggregation!r}: expected one of {', '.join(AGGREGATIONS)}",
                             parameter="objective")
        if self.new_tokens is not None and self.new_tokens < 1:
            raise InputError(f"new_tokens={self.new_tokens}: expected 1 or more", parameter="objective")
        if not (self.clip_eps > 0 and self.beta >= 0 and self.entropy_coef >= 0):
            raise InputError("clip_eps must be positive, beta and entropy_coef zero or more", parameter="objective")

    def lengths(self, length: int) -> tuple[int, int]:
        """The prompt's and the completion's tokens for input sequences of ``length`` tokens."""
        prompt = min(self.prompt_tokens or (length if self.new_tokens else max(1, length // 2)), length)
        new = self.new_tokens or length - prompt
        if prompt < 1 or new < 1:
            raise InputError(f"sequences of {length} token(s) leave no room for a prompt and a completion; "
                             "give longer ones, or new_tokens", parameter="objective")
        return prompt, new

    def words(self) -> str:
        """What the loss is, for the report's ``loss`` field."""
        adv = (f"group-normalised advantages over {self.group_size} completions per prompt" if self.group
               else "advantages against the batch's mean reward (no critic)")
        extra = "".join([f", k3 KL to the reference x {self.beta:g}" if self.beta else "",
                         f", entropy bonus x {self.entropy_coef:g}" if self.entropy_coef else ""])
        return (f"--objective {self.name}: clipped policy-gradient loss (ratio clip {self.clip_eps:g}, {adv}{extra}, "
                f"{self.aggregation}) on completions sampled from the model, with synthetic rewards")


# GRPO as verl's GRPO examples run it (k3 KL loss, weight 0.001; no entropy term); PPO without a critic.
OBJECTIVES: dict[str, Objective] = {
    "grpo": Objective("grpo", group=True, beta=0.001),
    "ppo": Objective("ppo", group=False),
}


def _logits(output: Any) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise InputError("an RL objective needs a causal LM's logits [batch, sequence, vocabulary]; "
                         "the model returned none", parameter="objective")
    return logits


def _synthetic_rewards(completions: torch.Tensor, vocab: int, seed: int) -> torch.Tensor:
    """A seeded uniform score per token id, averaged over each completion: ``[B]``."""
    table = torch.rand(vocab, generator=torch.Generator().manual_seed(seed + 7919)).to(completions.device)
    return table[completions].mean(-1)


@torch.no_grad()
def sampled_batch(model: nn.Module, input_ids: torch.Tensor, objective: Objective, gen: torch.Generator,
                  rewards: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One batch of the objective: prompts from ``input_ids`` ([B, T]) sampled ``group_size`` times to length T.

    ``rewards(prompts, completions) -> [B']`` scores the completions; None draws synthetic ones.
    Returns ``(sequences, logp_old, ref_logp, advantages)``.
    """
    batch, length = input_ids.shape
    prompt, new = objective.lengths(length)
    prompts = max(1, batch // objective.group_size)
    seqs = input_ids[:prompts, :prompt].repeat_interleave(objective.group_size, dim=0)
    for _ in range(new):
        logits = _logits(model(seqs)).float()
        probs = torch.softmax(logits[:, -1], dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=gen).to(seqs.device)
        seqs = torch.cat([seqs, nxt], dim=1)
    completions = seqs[:, prompt:]
    r = rewards(seqs[:, :prompt], completions) if rewards is not None else \
        _synthetic_rewards(completions, logits.shape[-1], seed)
    return rollout_batch(model, seqs, r, objective)


@torch.no_grad()
def rollout_batch(model: nn.Module, sequences: torch.Tensor, rewards: torch.Tensor,
                  objective: Objective) -> tuple[torch.Tensor, ...]:
    """One batch of the objective from completions already made: ``sequences`` [B, T] (each a prompt then its
    completion, ``group_size`` consecutive rows per prompt) and their ``rewards`` [B]; the rollout and
    reference log-probabilities are the model's, in fp32. Returns ``(sequences, logp_old, ref_logp, advantages)``.
    """
    if sequences.dim() != 2 or sequences.is_floating_point() or rewards.shape != sequences.shape[:1]:
        raise InputError(f"a rollout is token ids [batch, sequence] and one reward per row; got {tuple(sequences.shape)} "
                         f"{sequences.dtype} and rewards of shape {tuple(rewards.shape)}", parameter="objective")
    full = _logits(model(sequences)).float()
    logp, _ = token_logprobs(full, sequences)
    adv = advantages(rewards.to(full.device), objective.group_size, group=objective.group)
    return sequences, logp, logp.clone(), adv


def objective_batches(model: nn.Module, source: Batches | Iterable[Any], objective: Objective, count: int, *,
                      seed: int = 0,
                      rewards: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                      ) -> tuple[Batches, int]:
    """Sample ``count`` batches of the objective from ``source``'s token ids (a :class:`Batches`, or any
    iterable of ``[batch, sequence]`` id tensors or dicts with ``input_ids``), before any probe is attached;
    the batches and the prompt's length in tokens. ``rewards(prompts, completions) -> [B]`` scores the
    completions; None draws synthetic ones."""
    what = source.description if isinstance(source, Batches) else "the batches given"
    it = source.iterator if isinstance(source, Batches) else iter(source)
    gen = torch.Generator().manual_seed(seed)
    made, prompts = [], set()
    with _eval(model):
        for batch in itertools.islice(it, count):
            ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
                raise InputError("an RL objective samples from token ids: expected batches of input_ids "
                                 "[batch, sequence] (a causal LM)", parameter="objective")
            prompts.add(objective.lengths(ids.shape[1])[0])
            made.append(sampled_batch(model, ids, objective, gen, rewards, seed))
    if not made:
        raise InputError("an RL objective takes its prompts from the batches, and they gave none",
                         parameter="objective")
    if len(prompts) > 1:
        raise InputError(f"the batches' sequences give prompts of {sorted(prompts)} tokens; the loss needs one "
                         "length: give sequences of one length, or prompt_tokens", parameter="objective")
    (prompt,), g, length = prompts, objective.group_size, made[0][0].shape[1]
    desc = (f"{len(made)} batches of {made[0][0].shape[0] // g} prompt(s) x {g} completions of {length - prompt} "
            f"tokens sampled from the model (prompts: the first {prompt} tokens of {what})")
    return Batches(iter(made), desc, synthetic=True, labels="none: rewards "
                   + ("given" if rewards is not None else "synthetic (a seeded score per token id)"),
                   family=getattr(source, "family", None), notes=getattr(source, "notes", ())), prompt


def rollout_batches(model: nn.Module, rollouts: Iterable[tuple[torch.Tensor, torch.Tensor]], objective: Objective,
                    *, prompt_tokens: int) -> Batches:
    """The objective's batches from your own rollouts: each ``(sequences, rewards)``, sequences [B, T] whose first
    ``prompt_tokens`` tokens are the prompt (``group_size`` consecutive rows per prompt), rewards [B]. Nothing is
    sampled; the loss is :func:`objective_loss` with the same ``prompt_tokens`` and ``rewards_given=True``."""
    rollouts = list(rollouts)
    if not rollouts:
        raise InputError("no rollouts were given", parameter="objective")
    # refused before any forward runs (a rollout that is not [batch, sequence] ids: rollout_batch says so)
    if any(isinstance(seqs, torch.Tensor) and seqs.dim() == 2 and not 1 <= prompt_tokens < seqs.shape[1]
           for seqs, _ in rollouts):
        raise InputError(f"prompt_tokens={prompt_tokens}: expected fewer than every rollout's length",
                         parameter="objective")
    with _eval(model):
        made = [rollout_batch(model, seqs, rewards, objective) for seqs, rewards in rollouts]
    return Batches(iter(made), f"{len(made)} rollout batch(es) given, prompts of {prompt_tokens} tokens",
                   synthetic=False, labels="none: rewards given")


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def objective_loss(objective: Objective, *, prompt_tokens: int, rewards_given: bool = False) -> Loss:
    """The policy-gradient loss over a batch ``(input_ids, logp_old, ref_logp, advantages)``."""

    def rl_loss(output: Any, batch: Any) -> torch.Tensor:
        ids, logp_old, ref_logp, adv = batch
        logp, entropy = token_logprobs(_logits(output), ids)
        mask = torch.zeros_like(logp_old)
        mask[:, prompt_tokens - 1:] = 1  # position t predicts token t + 1: the completion's tokens
        return policy_loss(logp.float(), logp_old, adv, mask, clip_eps=objective.clip_eps,
                           ref_logp=ref_logp if objective.beta else None, beta=objective.beta,
                           entropy=entropy.float() if objective.entropy_coef else None,
                           entropy_coef=objective.entropy_coef, aggregation=objective.aggregation)

    words = objective.words()
    if rewards_given:
        words = words.replace("synthetic rewards", "the rewards given")
    return Loss(rl_loss, words, synthetic=not rewards_given)
