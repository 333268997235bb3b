"""What a step of the package's own, run on the user's model, leaves as it was: :func:`kept_training_state`.

Two passes run a training step (forward, loss, backward) on the user's model between the
user's own steps: the emulated target step (:mod:`fp16probe.capture.emulate`) and the fp32
shadow rerun (:mod:`fp16probe.capture.shadow`). Both run it inside :func:`kept_training_state`,
so training after them is what it would have been without them.

``verify`` steps deep copies of the model and op capture asks autocast on copies of an op's
inputs: nothing of the model changes there, and they keep only the random state
(``torch.random.fork_rng``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["kept_training_state"]


@contextlib.contextmanager
def kept_training_state(model: nn.Module) -> Iterator[None]:
    """Run an extra step on ``model`` inside this block; everything training sees is put back on the way out.

    Kept:

    - each of the model's buffers (BatchNorm's running statistics and ``num_batches_tracked``):
      the very tensor under its module and name, and its values;
    - the CPU random state and, when CUDA is initialised, every CUDA device's (dropout in the
      block draws the masks the next training step will draw again);
    - each trainable parameter's ``.grad``: the very tensor, or None.

    Inside the block every trainable parameter's ``.grad`` starts as None, so a backward there
    leaves the step's own gradients in ``.grad`` for the block to read before it ends. All of it
    is put back when the block ends, by an exception too (``KeyboardInterrupt`` included, one that lands
    while it is put back too: putting back is idempotent, and is done again whole). The
    weights are the caller's to leave alone (no optimizer steps in the block).

    Copies each buffer once on its device; no host sync.
    """
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules() for name, b in m.named_buffers(recurse=False)]
    cpu_rng = torch.get_rng_state()
    # an uninitialised CUDA ran nothing yet; asking it for its state would initialise it
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]

    def put_back() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for m, name, b, saved in buffers:
                if getattr(m, name, None) is not b:  # the step replaced it (a cache rebuilt): the old one goes back
                    setattr(m, name, b)  # a registered buffer's name: Module.__setattr__ sets the buffer
                b.copy_(saved)

    try:
        for p in params:
            p.grad = None
        yield
    finally:
        try:
            put_back()
        except KeyboardInterrupt:  # a stop signal landed in the middle of it: all of it again, then the signal
            put_back()
            raise
