"""FSDP2 (``fully_shard``): weight gradients are read from each rank's shard and add up across ranks."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fp16probe.capture.distributed import merge_rank_reports
from fp16probe.sections import CaptureNotes

sys.path.insert(0, str(Path(__file__).parent))
import ddp_worker  # noqa: E402
from test_distributed import _reference, _report, _torchrun_two_ranks  # noqa: E402


def test_empty_weight_gradients_on_every_rank_are_not_called_identical():
    merged = merge_rank_reports([_report({-20: 1}, {}), _report({-21: 1}, {})])
    assert merged.metadata.extra["weight_grads_identical_across_ranks"] is None
    assert merged.metadata.extra["weight_grad_merge"] == "sharded"


def test_a_rank_marked_sharded_is_summed_even_when_shards_look_alike():
    a, b = _report({-20: 1}, {-30: 4}), _report({-20: 1}, {-30: 4})
    assert merge_rank_reports([a, b]).metadata.extra["weight_grad_merge"] == "replicated"
    sharded = [replace(r, capture=CaptureNotes(weight_grads_sharded=True)) for r in (a, b)]
    merged = merge_rank_reports(sharded)
    assert merged.metadata.extra["weight_grad_merge"] == "sharded"
    assert merged.histogram("weight_grad").total == 8


@pytest.mark.slow
def test_fsdp2_two_gloo_ranks_give_the_single_process_weight_gradient_counts(tmp_path):
    merged, rank0, rank1 = _torchrun_two_ranks("fsdp_worker.py", tmp_path)
    ref_act, ref_weight = _reference()

    for rep in (rank0, rank1, merged):
        assert "hook_errors" not in rep.metadata.extra
        assert rep.capture.weight_grads_sharded
    # each rank holds a shard: neither alone has every parameter's values
    n_params = sum(p.numel() for p in ddp_worker.make_model().parameters())
    assert 0 < rank0.histogram("weight_grad").total < n_params * ddp_worker.STEPS
    assert merged.metadata.extra["weight_grad_merge"] == "sharded"
    assert merged.metadata.extra["weight_grads_identical_across_ranks"] is False
    assert merged.histogram("weight_grad").total == n_params * ddp_worker.STEPS
    for m in ref_weight.modules_of("weight_grad"):
        assert merged.module(m.name, "weight_grad").histogram == m.histogram
    assert merged.trace.histograms["weight_grad"] == ref_weight.trace.histograms["weight_grad"]
    assert merged.trace.histograms["activation_grad"] == ref_act.trace.histograms["activation_grad"]
    assert merged.trace.ceiling == tuple(max(a, b) for a, b in zip(rank0.trace.ceiling, rank1.trace.ceiling))
