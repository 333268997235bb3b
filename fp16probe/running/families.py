"""What a model is fed and trained on when the caller gives no batches: one plan per model family.

A profile measures the gradients of *a* loss; which loss decides the answer, since every
gradient is linear in the loss's gradient at the output. So the stand-in inputs and loss
are chosen to be the ones the model's task trains with, and always recorded as invented:

- Hugging Face models (``transformers``), by head: a causal LM trains on next-token
  cross-entropy (labels = input_ids), a masked LM on 15% masked tokens, a seq2seq model
  on target ids it is teacher-forced on, sequence and token classifiers, question
  answering and image classifiers on labels drawn the way the task draws them (classes
  uniform in ``[0, num_labels)``; regression targets standard normal); semantic
  segmentation on a per-pixel mask of patch-sized regions, object detection on drawn boxes
  and classes. Each uses the model's own loss. Image models get ``pixel_values`` shaped from the config's
  ``num_channels`` and ``image_size``. A base model without a head (``BertModel``,
  ``ViTModel``) keeps the documented default loss below.
- Any other ``nn.Module``: inputs shaped from its first layer (``Linear``: features;
  ``Conv1d/2d/3d``: channels; ``Embedding``: token ids), and the default loss.

The default loss (:class:`DecidingLoss`) decides at its first call: the model's own
``.loss`` when the output has one (labels came with the batch), else the batch's own targets
when it carries some that fit the output (a tuple's second element, a dict's ``labels``:
class ids get cross-entropy, values shaped like the output mean squared error), else
cross-entropy against uniformly random labels when the output is class logits ``[batch, classes]`` (what
classifiers train with, and the loss that puts realistic gradients at the output), else
the mean of squares of the floating outputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fp16probe.capture.probe import iter_tensors
from fp16probe.errors import InputError

__all__ = [
    "BATCH",
    "IMAGE_BATCH",
    "IMAGE_SIZE",
    "LABEL_KEYS",
    "NAMED_LOSSES",
    "SEQUENCE",
    "DecidingLoss",
    "Plan",
    "forward_signature",
    "hf_family",
    "hf_plan",
    "mean_of_squares",
    "module_plan",
    "named_loss",
    "no_inputs_error",
    "own_loss",
    "stand_in_line",
]

BATCH = 4  # sequences per synthetic batch of token ids
SEQUENCE = 32  # tokens per sequence (fewer when the model's positions are fewer)
IMAGE_BATCH = 4  # images (or rows) per synthetic batch
IMAGE_SIZE = 224  # side of a synthetic image when the model does not say (the ImageNet convention)
CONV_LENGTH = 256  # length of a synthetic Conv1d signal
VOLUME_SIZE = 32  # side of a synthetic Conv3d volume
MASK_SHARE = 0.15  # masked-LM share of masked positions (Devlin et al., BERT, arXiv:1810.04805)
LABEL_KEYS = ("labels", "label", "targets", "target", "y")

# Hugging Face heads, by the class name's ending: family name, what its labels are.
_HF_HEADS = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForConditionalGeneration", "seq2seq_lm"),
    ("ForSeq2SeqLM", "seq2seq_lm"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForTokenClassification", "token_classification"),
    ("ForQuestionAnswering", "question_answering"),
    ("ForImageClassification", "image_classification"),
    ("ForSemanticSegmentation", "semantic_segmentation"),
    ("ForObjectDetection", "object_detection"),
)


@dataclass(frozen=True)
class Plan:
    """Synthetic batches for one model: how to draw one, and what they and their labels are.

    ``loss`` describes the model's own loss on these labels (None: the default loss);
    ``configure`` is applied to the loaded model before the run (a setting the task needs).
    """

    family: str
    make: Callable[[torch.Generator], Any]
    inputs: str
    labels: str | None = None
    loss: str | None = None
    notes: tuple[str, ...] = ()
    configure: Mapping[str, Any] = field(default_factory=dict)
    shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()  # the big tensors, checked before drawing


# -- the model's forward ---------------------------------------------------------------


def _forward_parameters(cls: type) -> list[inspect.Parameter] | None:
    """forward()'s parameters after ``self``; None when its signature cannot be read."""
    try:
        return list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError, AttributeError):
        return None


def forward_signature(model: nn.Module | type) -> str:
    """Return ``Class.forward(a, b=None, ...)``: what the model says it takes."""
    cls = model if isinstance(model, type) else type(model)
    params = _forward_parameters(cls)
    if params is None:
        return f"{cls.__name__}.forward(...)"
    shown = []
    for p in params[:6]:
        if p.kind is p.VAR_POSITIONAL:
            shown.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            shown.append(f"**{p.name}")
        elif p.default is p.empty:
            shown.append(p.name)
        else:
            shown.append(f"{p.name}={p.default!r}"[:40])
    more = ", ..." if len(params) > 6 else ""
    return f"{cls.__name__}.forward({', '.join(shown)}{more})"


def _required_inputs(cls: type) -> list[str]:
    return [p.name for p in _forward_parameters(cls) or ()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _parameters(cls: type) -> list[str]:
    return [p.name for p in _forward_parameters(cls) or ()]


# forward() parameters that are a model's inputs when none is required (Hugging Face style:
# every argument defaults to None): input_ids, pixel_values, input_features, decoder_input_ids.
_INPUT_ENDINGS = ("_ids", "_values", "_features")
_NOT_INPUTS = ("position", "token_type", "past_key", "cache", "head_mask")


def _input_parameters(cls: type) -> list[str]:
    return [n for n in _parameters(cls) if n.endswith(_INPUT_ENDINGS) and not any(w in n for w in _NOT_INPUTS)]


def no_inputs_error(model: nn.Module | type, why: str) -> InputError:
    """The error for a model fp16probe cannot feed by itself: what forward() wants and how to supply it."""
    sig = forward_signature(model)
    cls = model if isinstance(model, type) else type(model)
    names = _required_inputs(cls) or _input_parameters(cls) or ["x"]
    example = ", ".join(f"'{n}': ..." for n in names[:3])
    return InputError(
        f"{why}; {sig} wants {', '.join(names)}: pass batches=package.module:function whose function "
        f"returns an iterable of batches (a tensor, a tuple of positional inputs, or a dict such as "
        f"{{{example}}}), or an input shape for a single tensor input", parameter="batches"
    )


# -- Hugging Face ----------------------------------------------------------------------


def hf_family(class_name: str) -> str | None:
    """The head family of a transformers class name (``GPT2LMHeadModel`` -> ``causal_lm``), or None."""
    for ending, family in _HF_HEADS:
        if class_name.endswith(ending):
            return family
    return None


def hf_plan(
    cls: type,
    config: Callable[[str], Any],
    *,
    shape: tuple[int, ...] | None = None,
    vocab_size: int | None = None,
) -> Plan:
    """Plan synthetic batches for a transformers class from its config (``config(key)`` reads one setting).

    Works from ``config.json`` before the model is built (to refuse early) and from the
    built model's config. ``shape`` overrides the batch shape: ``(batch, sequence)`` for
    token models, ``(batch, channels, height, width)`` for image models.
    """
    name = cls.__name__
    family = hf_family(name)
    params = _parameters(cls)
    if "input_ids" in params and "pixel_values" in params and family is None:
        raise no_inputs_error(cls, f"{name} takes token ids and images together (input_ids and pixel_values); "
                                   f"fp16probe draws one kind of synthetic input{_nested_words(config)}")
    if "input_ids" in params:
        draw = _token_draw(cls, family or "hf_base_text", config, shape, vocab_size)
        return _TOKEN_PLANS.get(draw.family, _Draw.plan)(draw)
    if "pixel_values" in params:
        draw = _image_draw(cls, family or "hf_base_image", config, shape)
        return _IMAGE_PLANS.get(draw.family, _Draw.plan)(draw)
    raise no_inputs_error(cls, f"fp16probe cannot make synthetic inputs for {name} (no input_ids or pixel_values)")


# Where multimodal and encoder-decoder configs keep their text model's settings.
_SUB_CONFIGS = ("text_config", "decoder", "language_config")


def _nested(config: Callable[[str], Any], key: str) -> tuple[str, int] | None:
    """Find ``key`` in a sub-config (CLIP's ``text_config.vocab_size``): (its dotted name, value), or None."""
    for sub in _SUB_CONFIGS:
        inner = config(sub)
        value = inner.get(key) if isinstance(inner, Mapping) else getattr(inner, key, None)
        if _positive(value):
            return f"{sub}.{key}", value
    return None


def _nested_words(config: Callable[[str], Any]) -> str:
    found = _nested(config, "vocab_size")
    return "" if found is None else f" (its vocabulary is {found[0]} = {found[1]})"


def _positive(value: Any) -> int | None:
    """``value`` when it is a positive int (a bool is not), else None: how a config setting is trusted."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _num_labels(config: Callable[[str], Any]) -> int:
    id2label = config("id2label")
    if isinstance(id2label, Mapping) and id2label:
        return len(id2label)
    return _positive(config("num_labels")) or 2  # transformers' own default


@dataclass(frozen=True)
class _Draw:
    """What every family's plan starts from: the model's synthetic input, its config, the notes so far."""

    family: str
    config: Callable[[str], Any]
    key: str  # the forward() argument: input_ids or pixel_values
    shape: tuple[int, ...]
    high: int | None = None  # token ids are drawn from [0, high); None: standard normal pixels
    notes: tuple[str, ...] = ()
    configure: Mapping[str, Any] = field(default_factory=dict)

    def inputs(self, gen: torch.Generator) -> torch.Tensor:
        """Draw one batch of the input."""
        if self.high is None:
            return torch.randn(self.shape, generator=gen)
        return torch.randint(0, self.high, self.shape, generator=gen)

    def plan(self, make: Callable[[torch.Generator], dict[str, Any]] | None = None, *, more: str = "",
             labels: str | None = None, loss: str | None = None) -> Plan:
        """The plan drawing ``make``'s batches (default: the input alone); ``more`` extends the inputs' description."""
        if self.high is None:
            batch, channels, height, width = self.shape
            text = f"{batch} standard normal images of {channels}x{height}x{width} (pixel_values)"
        else:
            text = f"{self.shape[0]} sequences of {self.shape[1]} uniform random token ids in [0, {self.high})"
        dtype = torch.float32 if self.high is None else torch.int64
        return Plan(self.family, make or (lambda gen: {self.key: self.inputs(gen)}), f"synthetic: {text}{more}",
                    labels=labels, loss=loss, notes=self.notes, configure=self.configure,
                    shapes=((self.shape, dtype),))


def _token_draw(cls: type, family: str, config: Callable[[str], Any],
                shape: tuple[int, ...] | None, vocab_size: int | None) -> _Draw:
    """Token ids: the vocabulary and sequence length from the config (or ``vocab_size``, ``shape``)."""
    name = cls.__name__
    vocab = vocab_size or _positive(config("vocab_size"))
    nested = _nested(config, "vocab_size") if vocab is None else None
    if nested is not None:
        vocab = nested[1]
    if vocab is None:
        raise no_inputs_error(cls, f"{name}'s config has no vocab_size (nor {', '.join(s + '.vocab_size' for s in _SUB_CONFIGS)}) "
                                   "to draw token ids from, and no vocab size was given")
    positions = next((p for k in ("max_position_embeddings", "n_positions", "n_ctx") if (p := _positive(config(k)))),
                     None)
    if shape is not None:
        if len(shape) != 2:
            raise InputError(f"input_shape={','.join(map(str, shape))}: {name} takes token ids; expected batch,sequence",
                             parameter="input_shape")
        batch, seq = shape
    else:
        batch, seq = BATCH, min(SEQUENCE, positions) if positions else SEQUENCE
    return _Draw(family, config, "input_ids", (batch, seq), high=vocab)


def _image_draw(cls: type, family: str, config: Callable[[str], Any], shape: tuple[int, ...] | None) -> _Draw:
    """Images: channels and size from the config (or ``shape``), with a note for each one assumed."""
    notes: list[str] = []
    if shape is not None:
        if len(shape) != 4:
            raise InputError(f"input_shape={','.join(map(str, shape))}: {cls.__name__} takes images; "
                             "expected batch,channels,height,width", parameter="input_shape")
        batch, channels, height, width = shape
    else:
        batch = IMAGE_BATCH
        channels = _positive(config("num_channels"))
        if channels is None:
            channels = 3
            notes.append("the config does not say num_channels: 3 assumed")
        size = config("image_size")
        if isinstance(size, (list, tuple)) and len(size) == 2:
            height, width = int(size[0]), int(size[1])
        elif _positive(size):
            height = width = size
        else:
            height = width = IMAGE_SIZE
            notes.append(f"the config does not say image_size: {IMAGE_SIZE}x{IMAGE_SIZE} assumed (the ImageNet size)")
    return _Draw(family, config, "pixel_values", (batch, channels, height, width), notes=tuple(notes))



# -- one plan per head family: the labels its task trains on ---------------------------


def _causal_lm(d: _Draw) -> Plan:
    def make(gen: torch.Generator) -> dict[str, Any]:
        x = d.inputs(gen)
        return {"input_ids": x, "labels": x}

    return d.plan(make, labels="labels = input_ids (the next tokens)",
                  loss="the model's own loss: cross-entropy of each next token (labels = input_ids, "
                       "shifted inside the model)")


def _masked_lm(d: _Draw) -> Plan:
    mask_id = d.config("mask_token_id")
    masked_with = f"mask_token_id {mask_id}" if isinstance(mask_id, int) else "random ids (no mask_token_id in the config)"

    def make(gen: torch.Generator) -> dict[str, Any]:
        x = d.inputs(gen)
        chosen = torch.rand(d.shape, generator=gen) < MASK_SHARE
        chosen[:, 0] |= ~chosen.any(dim=1)  # at least one masked token per row
        labels = torch.where(chosen, x, torch.full_like(x, -100))
        fill = (torch.full_like(x, mask_id) if isinstance(mask_id, int) else d.inputs(gen))
        return {"input_ids": torch.where(chosen, fill, x), "labels": labels}

    return d.plan(make, more=f", {MASK_SHARE:.0%} of positions replaced by {masked_with}",
                  labels="the original ids at the masked positions",
                  loss=f"the model's own loss: cross-entropy at the {MASK_SHARE:.0%} masked positions")


def _seq2seq_lm(d: _Draw) -> Plan:
    batch, target = d.shape[0], max(1, d.shape[1] // 2)
    pad = d.config("pad_token_id")
    first_id = pad if isinstance(pad, int) else 0
    shift = not isinstance(d.config("decoder_start_token_id"), int)
    if shift:
        d = replace(d, notes=(*d.notes, "the config has no decoder_start_token_id: decoder_input_ids are the "
                                        f"labels shifted right after a {first_id}"))

    def make(gen: torch.Generator) -> dict[str, Any]:
        x = d.inputs(gen)
        y = torch.randint(0, d.high, (batch, target), generator=gen)
        out = {"input_ids": x, "labels": y}
        if shift:
            first = torch.full((batch, 1), first_id, dtype=y.dtype)
            out["decoder_input_ids"] = torch.cat([first, y[:, :-1]], dim=1)
        return out

    return d.plan(make, more=f"; {batch} target sequences of {target} random ids",
                  labels=f"random target ids in [0, {d.high}), teacher-forced",
                  loss="the model's own loss: cross-entropy of the decoder's tokens against the target ids")


def _classification(d: _Draw) -> Plan:
    """Sequence and image classifiers: one label (or target) per row."""
    if d.high is not None and d.config("pad_token_id") is None:
        # Decoder-style classifiers pool each row's last non-pad token and refuse a batch
        # without a pad id; reserve the last id as pad and never draw it.
        pad = d.high - 1
        d = replace(d, high=pad, configure={"pad_token_id": pad},
                    notes=(*d.notes, f"config.pad_token_id was unset: set to {pad} (never drawn) so the "
                                     "classifier pools each row's last token"))
    labels_of, labels_text, loss_text = _class_labels(d.config, d.shape[:1], "image" if d.high is None else "sequence")

    def make(gen: torch.Generator) -> dict[str, Any]:
        return {d.key: d.inputs(gen), "labels": labels_of(gen)}

    return d.plan(make, labels=labels_text, loss=loss_text)


def _token_classification(d: _Draw) -> Plan:
    n = _num_labels(d.config)

    def make(gen: torch.Generator) -> dict[str, Any]:
        return {"input_ids": d.inputs(gen), "labels": torch.randint(0, n, d.shape, generator=gen)}

    return d.plan(make, labels=f"a uniform random label in [0, {n}) per token",
                  loss=f"the model's own loss: cross-entropy of each token's label over {n} labels")


def _question_answering(d: _Draw) -> Plan:
    batch, seq = d.shape

    def make(gen: torch.Generator) -> dict[str, Any]:
        start = torch.randint(0, seq, (batch,), generator=gen)
        end = torch.minimum(start + torch.randint(0, 4, (batch,), generator=gen), torch.tensor(seq - 1))
        return {"input_ids": d.inputs(gen), "start_positions": start, "end_positions": end}

    return d.plan(make, labels="answer spans: a uniform random start, ending 0-3 tokens later",
                  loss="the model's own loss: cross-entropy of the answer's start and end positions")


# family -> its plan, for models fed token ids and for models fed images; any other family
# (a base model without a head) gets the input alone and the default loss.
_TOKEN_PLANS: dict[str, Callable[[_Draw], Plan]] = {
    "causal_lm": _causal_lm,
    "masked_lm": _masked_lm,
    "seq2seq_lm": _seq2seq_lm,
    "sequence_classification": _classification,
    "token_classification": _token_classification,
    "question_answering": _question_answering,
}
SEGMENT_PATCH = 16  # a drawn segmentation mask holds one class per 16x16 patch: regions, not pixel noise
MAX_BOXES = 4  # a drawn detection target holds 1 to 4 boxes per image


def _semantic_segmentation(d: _Draw) -> Plan:
    """Per-pixel class ids at the image's size: one uniform random class per patch, so the mask has regions."""
    batch, _, height, width = d.shape
    n = _num_labels(d.config)
    classes = 2 if n == 1 else n  # one label: a binary mask (the model's loss is then BCE)
    rows, cols = -(-height // SEGMENT_PATCH), -(-width // SEGMENT_PATCH)

    def make(gen: torch.Generator) -> dict[str, Any]:
        coarse = torch.randint(0, classes, (batch, rows, cols), generator=gen)
        mask = coarse.repeat_interleave(SEGMENT_PATCH, 1).repeat_interleave(SEGMENT_PATCH, 2)[:, :height, :width]
        return {"pixel_values": d.inputs(gen), "labels": mask}

    loss = ("binary cross-entropy of each pixel" if n == 1 else f"cross-entropy of each pixel's class over {n} classes")
    return d.plan(make, labels=f"a {height}x{width} mask per image: a uniform random class in [0, {classes}) "
                               f"per {SEGMENT_PATCH}x{SEGMENT_PATCH} patch",
                  loss=f"the model's own loss: {loss} (logits upsampled to the mask)")


def _object_detection(d: _Draw) -> Plan:
    """Per image, 1 to MAX_BOXES boxes (centre x, y and width, height as shares of the image) with classes."""
    batch = d.shape[0]
    n = _num_labels(d.config)

    def make(gen: torch.Generator) -> dict[str, Any]:
        targets = []
        for _ in range(batch):
            k = int(torch.randint(1, MAX_BOXES + 1, (1,), generator=gen))
            size = 0.05 + 0.35 * torch.rand((k, 2), generator=gen)  # width, height: 5% to 40% of the image
            centre = size / 2 + (1 - size) * torch.rand((k, 2), generator=gen)  # the box lies inside the image
            targets.append({"class_labels": torch.randint(0, n, (k,), generator=gen),
                            "boxes": torch.cat([centre, size], dim=1)})
        return {"pixel_values": d.inputs(gen), "labels": targets}

    return d.plan(make, labels=f"1 to {MAX_BOXES} boxes per image (centre uniform inside it, sides 5% to 40% of it), "
                               f"each of a uniform random class in [0, {n})",
                  loss="the model's own loss: its set-matching loss over the drawn boxes and classes "
                       "(class cross-entropy, box L1 and generalised IoU, as the model's config weighs them)")


_IMAGE_PLANS: dict[str, Callable[[_Draw], Plan]] = {
    "image_classification": _classification,
    "semantic_segmentation": _semantic_segmentation,
    "object_detection": _object_detection,
}


def _class_labels(config: Callable[[str], Any], shape: tuple[int, ...],
                  what: str) -> tuple[Callable[[torch.Generator], torch.Tensor], str, str]:
    """Labels the way a classification config says its task draws them, and the loss that follows."""
    n = _num_labels(config)
    problem = config("problem_type")
    if problem == "regression" or (problem is None and n == 1):
        return (lambda gen: torch.randn((*shape, n), generator=gen).squeeze(-1),
                f"standard normal regression targets ({n} per {what})",
                "the model's own loss: mean squared error against the targets")
    if problem == "multi_label_classification":
        return (lambda gen: (torch.rand((*shape, n), generator=gen) < 0.5).float(),
                f"random 0/1 targets for each of {n} labels",
                "the model's own loss: binary cross-entropy with logits against the targets")
    return (lambda gen: torch.randint(0, n, shape, generator=gen),
            f"a uniform random class in [0, {n}) per {what}",
            f"the model's own loss: cross-entropy over {n} classes")


# -- any other module ------------------------------------------------------------------


def module_plan(model: nn.Module) -> Plan:
    """Plan synthetic inputs for a plain module from its first layer; raise InputError naming forward() if unclear."""
    required = _required_inputs(type(model))
    if len(required) > 1:
        raise no_inputs_error(model, f"{type(model).__name__} takes {len(required)} inputs")
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    batch = IMAGE_BATCH * 2
    if isinstance(first, nn.Linear):
        shape: tuple[int, ...] = (batch, first.in_features)
        why = f"its first layer is Linear({first.in_features}, ...)"
    elif isinstance(first, nn.Conv2d):
        shape = (IMAGE_BATCH, first.in_channels, IMAGE_SIZE, IMAGE_SIZE)
        why = f"its first layer is Conv2d({first.in_channels}, ...); {IMAGE_SIZE}x{IMAGE_SIZE} is the ImageNet size"
    elif isinstance(first, nn.Conv1d):
        shape = (batch, first.in_channels, CONV_LENGTH)
        why = f"its first layer is Conv1d({first.in_channels}, ...); length {CONV_LENGTH} assumed"
    elif isinstance(first, nn.Conv3d):
        shape = (IMAGE_BATCH, first.in_channels, VOLUME_SIZE, VOLUME_SIZE, VOLUME_SIZE)
        why = f"its first layer is Conv3d({first.in_channels}, ...); {VOLUME_SIZE}^3 volumes assumed"
    elif isinstance(first, nn.Embedding):
        n = first.num_embeddings

        def tokens(gen: torch.Generator) -> torch.Tensor:
            return torch.randint(0, n, (BATCH, SEQUENCE), generator=gen)

        return Plan("module", tokens,
                    f"synthetic: {BATCH} sequences of {SEQUENCE} uniform random ids in [0, {n}) "
                    f"(its first layer is Embedding({n}, ...))")
    else:
        what = type(first).__name__ if first is not None else "no layer with parameters"
        raise no_inputs_error(model, f"fp16probe cannot tell {type(model).__name__}'s input shape (first layer: {what})")

    def values(gen: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    return Plan("module", values, f"synthetic: standard normal float32 of shape {list(shape)} ({why})",
                shapes=((shape, torch.float32),))


# -- losses ----------------------------------------------------------------------------


def _output_field(output: Any, name: str) -> Any:
    """The output's entry ``name`` (a dict's key, a ModelOutput's or any object's attribute), None when absent."""
    return output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)


def _prediction(output: Any) -> torch.Tensor:
    """The tensor a loss compares with targets: the output, its ``logits``, or its first floating tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = _output_field(output, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    for t in iter_tensors(output):
        if t.is_floating_point():
            return t
    raise InputError("the model's output holds no floating-point tensor to compute a loss from; pass loss=",
                     parameter="loss")


def _targets(batch: Any) -> torch.Tensor | None:
    """The targets a batch carries: a tuple's second element, or a dict's labels/targets entry."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    if isinstance(batch, Mapping):
        for key in LABEL_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
    return None


def mean_of_squares(output: Any) -> torch.Tensor:
    """Return the sum over the output's floating tensors that need a gradient of the mean of their squares."""
    terms = [t.float().pow(2).mean() for t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not terms:
        raise InputError(
            "the model's output holds no floating-point tensor that needs a gradient; pass loss= "
            "(a function (output, batch) -> scalar loss, e.g. package.module:function)", parameter="loss"
        )
    return torch.stack(terms).sum()


def own_loss(output: Any) -> torch.Tensor | None:
    """Return the model's own scalar ``.loss`` (or ``["loss"]``) as a 0-d tensor, None when it has none."""
    own = _output_field(output, "loss")
    if isinstance(own, torch.Tensor) and own.numel() == 1:
        return own.reshape(())
    return None


def _is_class_logits(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.dim() == 2 and t.shape[0] >= 1 and t.shape[1] >= 2


class _RandomLabels:
    """Uniform random class labels (and 0/1 targets), seeded, drawn on the logits' device."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The seeded generator for ``device`` (one per device, made on first use)."""
        gen = self.generators.get(device)
        if gen is None:
            gen = self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def __call__(self, logits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Draw labels of ``shape`` for the classes of ``logits``' last dimension."""
        return torch.randint(0, logits.shape[-1], shape, generator=self.generator(logits.device), device=logits.device)


class DecidingLoss:
    """A loss that decides at its first call which way it computes, and then keeps to it.

    ``decided`` is None before the first call, then ``(description, synthetic)``: what
    the report records. The choice depends on the output, which only the run shows.
    """

    def __init__(self, seed: int = 0) -> None:
        self.decided: tuple[str, bool] | None = None
        self.invented_targets: str | None = None  # set when the batches' targets were drawn by fp16probe
        self._way: str | None = None
        self._labels = _RandomLabels(seed)

    def __call__(self, output: Any, batch: Any) -> torch.Tensor:
        """Compute the loss of one step."""
        if self._way is None:
            self._decide(output, batch)
        if self._way == "own":
            own = own_loss(output)
            if own is None:
                raise InputError("the model returned a .loss at the first step but not at this one; pass loss=",
                                 parameter="loss")
            return own
        if self._way == "cross_entropy":
            logits = _prediction(output)
            return F.cross_entropy(logits.float(), self._labels(logits, (logits.shape[0],)))
        if self._way == "batch_labels":
            rows, _ = _classes(_prediction(output).float())
            return F.cross_entropy(rows, _targets(batch).reshape(-1).long().to(rows.device), ignore_index=-100)
        if self._way == "batch_targets":
            pred = _prediction(output).float()
            return F.mse_loss(pred, _targets(batch).float().reshape(pred.shape).to(pred.device))
        return mean_of_squares(output)

    def _decide(self, output: Any, batch: Any = None) -> None:
        if own_loss(output) is not None:
            self._way = "own"
            self.decided = ("the model's own output .loss, on the labels the batches carry", False)
            return
        try:
            pred = _prediction(output)
        except InputError:
            pred = None
        plain = isinstance(output, torch.Tensor) or (pred is not None and not isinstance(output, (tuple, list)))
        target = _targets(batch)
        if pred is not None and target is not None and self._fits(pred, target):
            return
        if pred is not None and plain and _is_class_logits(pred) and _counts_logits(output, pred):
            self._way = "cross_entropy"
            self.decided = (f"default for class logits [batch, {pred.shape[1]}]: cross-entropy against uniformly "
                            f"random labels in [0, {pred.shape[1]})", True)
            return
        self._way = "mean_of_squares"
        self.decided = ("default: mean of squares of the model's floating-point outputs", True)

    def _fits(self, pred: torch.Tensor, target: torch.Tensor) -> bool:
        """Train on the batch's own targets when they fit the output: class ids, else values of its shape."""
        invented = self.invented_targets is not None
        whose = f"invented ({self.invented_targets})" if invented else "the batch's own"
        if (pred.is_floating_point() and pred.dim() >= 2 and not target.is_floating_point()
                and target.numel() == pred.numel() // pred.shape[-1]):
            self._way = "batch_labels"
            self.decided = (f"default for class logits [..., {pred.shape[-1]}]: cross-entropy against "
                            f"{whose} labels", invented)
            return True
        if pred.is_floating_point() and target.is_floating_point() and target.numel() == pred.numel():
            self._way = "batch_targets"
            self.decided = (f"default for an output shaped like the batch's targets: mean squared error "
                            f"against {whose} targets", invented)
            return True
        return False


def _counts_logits(output: Any, pred: torch.Tensor) -> bool:
    """Whether ``pred`` is the output itself or its named ``logits`` (not some other tensor in it)."""
    if output is pred:
        return True
    logits = _output_field(output, "logits")
    return logits is pred


def _classes(pred: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Logits as [N, C] rows (a [batch, seq, C] sequence flattened)."""
    if pred.dim() < 2:
        raise InputError(f"loss=cross_entropy: the output has shape {list(pred.shape)}, expected logits [batch, classes]",
                         parameter="loss")
    return pred.reshape(-1, pred.shape[-1]), pred.shape[-1]


class NamedLoss:
    """A built-in loss by name: against the batch's targets, or targets drawn the way the task would."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.decided: tuple[str, bool] | None = None
        self.invented_targets: str | None = None  # set when the batches' labels were drawn by fp16probe
        self._labels = _RandomLabels(seed)

    def __call__(self, output: Any, batch: Any) -> torch.Tensor:
        """Compute the loss of one step."""
        pred = _prediction(output).float()
        target = _targets(batch)
        if self.decided is None:
            base = NAMED_LOSSES[self.name][1]
            if target is None:
                self.decided = (f"--loss {self.name}: {base} against {NAMED_LOSSES[self.name][2]}", True)
            elif self.invented_targets:
                self.decided = (f"--loss {self.name}: {base} against the batch's invented targets "
                                f"({self.invented_targets})", True)
            else:
                self.decided = (f"--loss {self.name}: {base} against the batch's targets", False)
        fn = NAMED_LOSSES[self.name][0]
        if self.name in ("cross_entropy", "nll"):
            rows, _ = _classes(pred)
            if target is None:
                target = self._labels(rows, (rows.shape[0],))
            return fn(rows, target.reshape(-1).long().to(rows.device), ignore_index=-100)
        if self.name == "bce_with_logits":
            if target is None:
                gen = self._labels.generator(pred.device)
                target = (torch.rand(pred.shape, generator=gen, device=pred.device) < 0.5).float()
        elif target is None:
            target = torch.zeros_like(pred)
        return fn(pred, target.float().reshape(pred.shape))


# name: (the function, what it computes, what it compares with when the batch has no targets)
NAMED_LOSSES: dict[str, tuple[Callable[..., torch.Tensor], str, str]] = {
    "cross_entropy": (F.cross_entropy, "cross-entropy of the logits", "uniformly random class labels"),
    "nll": (F.nll_loss, "negative log-likelihood of log-probabilities", "uniformly random class labels"),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, "binary cross-entropy of the logits",
                        "random 0/1 targets"),
    "mse": (F.mse_loss, "mean squared error", "zeros (the mean of squares)"),
    "l1": (F.l1_loss, "mean absolute error", "zeros (the mean absolute value)"),
    "smooth_l1": (F.smooth_l1_loss, "smooth L1 (Huber) loss", "zeros"),
}


def named_loss(name: str, seed: int = 0) -> NamedLoss:
    """The built-in loss ``name`` (a key of NAMED_LOSSES)."""
    if name not in NAMED_LOSSES:
        raise InputError(f"loss={name!r}: expected one of {', '.join(NAMED_LOSSES)} or package.module:function",
                         parameter="loss")
    return NamedLoss(name, seed)


# -- what the summary says -------------------------------------------------------------


def stand_in_line(*, inputs_synthetic: bool, loss: str, loss_synthetic: bool, labels: str | None = None) -> str:
    """One line saying what was invented for the run and how much the answer depends on it ('' if nothing).

    ``labels`` is set when fp16probe drew the labels for the model's own loss. The
    dependence is exact: backward is linear in the loss's gradient at the output, so
    scaling that gradient by 2^k shifts every gradient, and the scale S, by k powers of two.
    """
    made = ["random inputs"] if inputs_synthetic else []
    if loss_synthetic and labels:
        made.append("labels (for the model's own loss)")
    elif loss_synthetic:
        made.append(f"loss ({_short_loss(loss)})")
    if not made:
        return ""
    return (f"invented {' and '.join(made)}; S shifts by k powers of two when the loss's gradient at the "
            "output is 2^k larger or smaller: pass --batches/--loss for your own")


def _short_loss(description: str) -> str:
    if description.startswith("default for class logits"):
        return "cross-entropy against random labels"
    if description.startswith("default: mean of squares"):
        return "mean of squares of the outputs"
    if description.startswith("--loss "):
        return description.split(":", 1)[0] + " against invented targets"
    return description


def iter_plan(plan: Plan, seed: int) -> Iterator[Any]:
    """Yield the plan's batches forever, seeded."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield plan.make(gen)
