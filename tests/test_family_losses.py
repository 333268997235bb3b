"""Segmentation and detection models are profiled on their own losses (per-pixel labels; boxes and
classes through the model's set-matching loss), not on an invented stand-in, and the verdict on
them holds in a real fp16 autocast step judged by the gradients' error against fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import fp16probe
from fp16probe.running.families import SEGMENT_PATCH, hf_plan

SHAPE = (2, 3, 64, 64)


def _segformer():
    import transformers as t

    torch.manual_seed(0)
    return t.SegformerForSemanticSegmentation(t.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16,
        num_labels=4, image_size=64))


def _detr():
    import transformers as t

    torch.manual_seed(0)
    return t.DetrForObjectDetection(t.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=t.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"]),
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8, num_labels=5))


def _batch(model):
    plan = hf_plan(type(model), lambda key: getattr(model.config, key, None), shape=SHAPE)
    return plan, plan.make(torch.Generator().manual_seed(0))


def test_segformer_trains_on_per_pixel_labels_with_its_own_cross_entropy():
    model = _segformer()
    plan, batch = _batch(model)
    assert plan.family == "semantic_segmentation" and plan.loss.startswith("the model's own loss")
    mask = batch["labels"]
    assert mask.shape == (2, 64, 64) and mask.dtype == torch.int64 and 0 <= mask.min() and mask.max() < 4
    patches = mask.unfold(1, SEGMENT_PATCH, SEGMENT_PATCH).unfold(2, SEGMENT_PATCH, SEGMENT_PATCH)
    assert (patches == patches[..., :1, :1]).all() and len(mask.unique()) > 1  # regions of one class each
    out = model(**batch)
    logits = F.interpolate(out.logits, size=mask.shape[-2:], mode="bilinear", align_corners=False)
    torch.testing.assert_close(out.loss, F.cross_entropy(logits, mask))  # the per-pixel loss, by hand


def test_detr_trains_on_drawn_boxes_and_classes_through_its_set_matching_loss():
    pytest.importorskip("scipy")  # DETR's Hungarian matcher
    model = _detr()
    plan, batch = _batch(model)
    assert plan.family == "object_detection" and plan.loss.startswith("the model's own loss")
    for target in batch["labels"]:
        boxes = target["boxes"]
        assert 1 <= len(boxes) <= 4 and len(target["class_labels"]) == len(boxes)
        assert ((boxes[:, :2] - boxes[:, 2:] / 2) >= 0).all() and ((boxes[:, :2] + boxes[:, 2:] / 2) <= 1).all()
    out = model(**batch)
    assert {"loss_ce", "loss_bbox", "loss_giou"} <= set(out.loss_dict)
    out.loss.backward()  # the box head learns from the boxes: a stand-in on the logits alone would not say where
    assert model.bbox_predictor.layers[-1].weight.grad.abs().sum() > 0


def _grads(model, batch, *, scale: float | None):
    """One whole step (forward, the model's loss, backward) in fp32 (scale None) or fp16 autocast with loss x scale."""
    model.zero_grad(set_to_none=True)
    if scale is None:
        model(**batch).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    (loss.float() * scale).backward()
    return [p.grad.float() / scale for p in model.parameters() if p.grad is not None]


@pytest.mark.slow
def test_the_segformer_verdict_holds_in_a_real_fp16_step(tmp_path):
    model = _segformer()
    plan, batch = _batch(model)
    report = fp16probe.profile(model, batches=[batch] * 2, steps=2)
    rec = report.recommendation
    assert report.workload.loss.startswith("the model's own output .loss")
    assert rec.log2_scale is not None and rec.log2_scale > 0, rec

    reference = _grads(model, batch, scale=None)

    def zeroed(scale: float) -> float:
        got = _grads(model, batch, scale=scale)
        nonzero = sum(int((r != 0).sum()) for r in reference)
        return sum(int(((g == 0) & (r != 0)).sum()) for g, r in zip(got, reference)) / nonzero

    at_1, at_s = zeroed(1.0), zeroed(2.0 ** rec.log2_scale)
    # The measured effect: at S = 1 fp16 zeroes gradients fp32 keeps (9.9% here), the recommended S keeps
    # them (0%). (The whole-gradient relative error is ~0.24 at every S on this random model: fp16 rounding,
    # not underflow, dominates it, so it cannot tell the scales apart.)
    assert at_s < at_1 and at_s <= 2 * rec.flushed_fraction_at_scale + 1e-3, (at_1, at_s, rec)


@pytest.mark.slow
def test_the_detr_verdict_holds_in_a_real_fp16_step():
    """The tiny random DETR's gradients span more than fp16 holds: no S both keeps them and stays finite.

    And fp16 moves them further than any S can: its Hungarian matching is a discrete choice made on the
    fp16 costs, and in this step fp16 assigns other queries to the boxes than fp32 does (measured), so
    the real fp16 gradients are far from fp32's at every S. The emulated step sees that (gradient_error);
    the gradients' own verdict, the S to use, is kept as the backward verdict.
    """
    pytest.importorskip("scipy")
    model = _detr()
    plan, batch = _batch(model)
    rec = fp16probe.profile(model, batches=[batch] * 2, steps=2).recommendation
    assert rec.verdict.value == "gradient_error" and rec.evidence["backward_verdict"] == "no_single_scale", rec
    assert rec.log2_scale is not None

    reference = _grads(model, batch, scale=None)
    nonzero = sum(int((r != 0).sum()) for r in reference)

    def measured(log2_scale: int) -> tuple[float, int]:
        got = _grads(model, batch, scale=2.0 ** log2_scale)
        zeroed = sum(int(((g == 0) & (r != 0)).sum()) for g, r in zip(got, reference)) / nonzero
        return zeroed, sum(int((~torch.isfinite(g)).sum()) for g in got)

    at_1, at_s, above = measured(0), measured(rec.log2_scale), measured(rec.log2_scale + 5)
    named = [n for n, p in model.named_parameters() if p.grad is not None].index(rec.evidence["emulated"]["first_parameter"])
    real = _grads(model, batch, scale=2.0 ** rec.log2_scale)[named]
    assert float((real - reference[named]).norm() / reference[named].norm()) > 0.05  # the real run: off, as said
    # Measured (torch 2.13, CPU): 11.4% zeroed at S = 1; 2.3% at the least bad S = 2^5 (predicted 2.6%), all
    # finite; 2^5 higher, 4,027 gradient values are inf/NaN. Neither side reaches the 0.1% threshold.
    assert at_s[1] == 0 and at_s[0] < at_1[0]
    assert abs(at_s[0] - rec.flushed_fraction_at_scale) < 0.01, (at_s, rec.flushed_fraction_at_scale)
    assert at_s[0] > 1e-3 and above[1] > 0, (at_s, above)


def test_the_extras_that_bring_the_detection_family_bring_scipy():
    """transformers' *ForObjectDetection losses match boxes with scipy: [hf] brings the family, [dev] runs its tests
    (without it the DETR tests above skip, and a fresh [hf] install stopped at step 1)."""
    import tomllib

    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in ("hf", "dev"):
        assert any(req.split(">")[0].split("=")[0].strip() == "scipy" for req in extras[extra]), extra
