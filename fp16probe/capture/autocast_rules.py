"""What dtype an op's output would have in the target run, asked of torch's own dispatcher.

A profile runs in fp32, often on a CPU; the run it predicts computes under CUDA fp16
autocast (or CPU autocast, or a model converted with ``.half()``). Which ops autocast
lowers to fp16, which it runs in fp32 and which it passes through differs by device
(torch's "Autocast Op Reference": on CUDA ``pow``, ``sum``, ``softmax``, ``layer_norm`` and
``exp`` run in fp32, on the CPU in fp16). Nothing here relies on a typed-in table when
torch can answer: the op is run on *fake* tensors (``torch._subclasses.FakeTensorMode``,
shapes and dtypes only, no data, no device needed) of the dtypes the target run would have,
with the target device's autocast switched on, and the output's dtype is read off. Fake
CUDA tensors work on a CPU-only build, and CUDA autocast's own kernels (registered in
every build) decide. Answers are cached per op and input-dtype signature.

Where the fake call fails (an op without a fake kernel, a data-dependent op), the
documented lists below decide (the target device's), and otherwise type promotion (fp16 out
only when every floating input is fp16). The CUDA lists are torch's "CUDA Ops that can
autocast to float16 / float32" for torch 2.4-2.13 (its "promote" list is the type-promotion
rule, so it needs no list here), the CPU lists its AutocastCPU registrations;
``bench/gpu_check.py`` checks the CUDA answers against a real GPU when one is at hand, and
the suite checks the CPU answers against CPU autocast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "CAST_OPS",
    "CUDA_FP16_OPS",
    "CUDA_FP32_OPS",
    "CPU_FP16_OPS",
    "CPU_FP32_OPS",
    "REGIMES",
    "TARGETS",
    "answering_autocast_state",
    "around_autocast",
    "cast_is_low",
    "compare_with_device",
    "op_name",
    "output_is_low",
]

TARGETS = ("cuda", "cpu")
REGIMES = ("autocast", "pure_fp16")

# torch's Autocast Op Reference, CUDA, torch 2.4-2.13 (the Python names the ops are called by).
CUDA_FP16_OPS = frozenset({
    "matmul", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "gru_cell", "linear", "lstm_cell", "mm", "mv", "prelu", "rnn_tanh_cell",
    "rnn_relu_cell", "scaled_dot_product_attention", "_convolution", "convolution",
})
CUDA_FP32_OPS = frozenset({
    "pow", "rdiv", "rpow", "rtruediv", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
    "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
    "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss",
    "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss", "rms_norm",
    "batch_norm", "instance_norm", "native_layer_norm",
})

# torch's AutocastCPU registrations (aten/src/ATen/autocast_mode.cpp, torch 2.4-2.13), by the
# Python names the ops are called by. The fallback needs them for ops no fake run can answer:
# ctc_loss, whose output shape depends on its data, is fp32 on CPU autocast whatever its inputs.
CPU_FP16_OPS = frozenset({
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm", "linear",
    "_convolution", "matmul", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
    "scaled_dot_product_attention",
})
CPU_FP32_OPS = frozenset({
    "avg_pool3d", "binary_cross_entropy", "grid_sample", "grid_sampler", "polar", "prod", "quantile",
    "nanquantile", "stft", "cdist", "trace", "view_as_complex", "cholesky", "cholesky_inverse",
    "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d", "max_unpool2d",
    "max_unpool3d", "adaptive_avg_pool3d", "mse_loss", "cosine_embedding_loss", "nll_loss",
    "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy", "l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div",
    "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2",
    "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn",
    "fft_irfftn", "fft_hfft", "fft_ihfft", "qr", "svd", "triangular_solve", "geqrf",
    "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d",
})
_LISTS = {"cuda": (CUDA_FP16_OPS, CUDA_FP32_OPS), "cpu": (CPU_FP16_OPS, CPU_FP32_OPS)}

_LOW_DTYPES = (torch.float16, torch.bfloat16)
CAST_OPS = frozenset({"to", "type", "float", "double", "half", "bfloat16"})  # explicit dtype conversions


def cast_is_low(op: str, args: Sequence[Any], kwargs: dict[str, Any],
                is_low: Callable[[torch.Tensor], bool]) -> bool | None:
    """What an explicit conversion makes: fp16/bf16 (True) or not (False); None when it changes no float dtype.

    ``.to(other)`` takes ``other``'s dtype as it would be in the target run (``is_low``).
    """
    if op in ("half", "bfloat16"):
        return True
    if op in ("float", "double"):
        return False
    for a in list(args[1:]) + list(kwargs.values()):
        if isinstance(a, torch.dtype):
            return a in _LOW_DTYPES if a.is_floating_point else None
        if isinstance(a, torch.Tensor):
            return is_low(a) if a.is_floating_point() else None
        if isinstance(a, str) and a.endswith(("HalfTensor", "BFloat16Tensor")):
            return True
    return None  # .to(device), .type() with no dtype
_cache: dict[tuple[Any, ...], bool | None] = {}
_lock = threading.Lock()
# One FakeTensorMode per thread: a mode keeps its in-kernel state on itself, and two threads' fake
# calls through one mode fail ("AssertionError: False, True"), an answer then cached as unknown.
_fake_modes = threading.local()
_fake_lock = threading.RLock()
_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def _fake_mode() -> Any:
    """This thread's FakeTensorMode, made on first use with the process left as found.

    Making the first one imports ``torch._dynamo``, which sets ``TORCHINDUCTOR_CACHE_DIR`` in
    ``os.environ``, and sympy, which adds a warnings filter: a profile would leave both behind.
    """
    mode = getattr(_fake_modes, "mode", None)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        cache_dir = os.environ.get(_INDUCTOR_CACHE)
        try:
            with warnings.catch_warnings():  # the filters as they were, on the way out
                mode = _fake_modes.mode = FakeTensorMode(allow_non_fake_inputs=False)
        finally:
            if cache_dir is None:
                os.environ.pop(_INDUCTOR_CACHE, None)
            else:
                os.environ[_INDUCTOR_CACHE] = cache_dir
    return mode


def op_name(func: Any) -> str:
    """Name a torch callable for a report row: ``TensorBase.__getitem__`` -> ``"getitem"``."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


def output_is_low(func: Any, args: Sequence[Any], kwargs: dict[str, Any], is_low: Callable[[torch.Tensor], bool],
                  target: str, regime: str = "autocast") -> bool:
    """Whether ``func``'s floating output would be fp16 in the target run.

    ``is_low(t)`` says whether an input tensor would be fp16 there. ``regime`` is
    ``"autocast"`` (fp16 autocast on ``target``) or ``"pure_fp16"`` (a ``.half()`` model, no
    autocast: type promotion and explicit casts alone decide).
    """
    sig: list[Any] = []
    floats: list[bool] = []

    def note(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            low = obj.is_floating_point() and is_low(obj)
            if obj.is_floating_point() and obj.dim() > 0:
                floats.append(low)
            sig.append(("T", str(obj.dtype) if not obj.is_floating_point() else low, obj.dim() == 0))
        elif isinstance(obj, (torch.dtype, str, bool)):
            sig.append(obj)
        elif isinstance(obj, (list, tuple)):
            sig.append(len(obj))
            for v in obj:
                note(v)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                sig.append(k)
                note(v)
        else:
            sig.append(type(obj).__name__)
        return obj

    for a in args:
        note(a)
    for k in sorted(kwargs):
        sig.append(k)
        note(kwargs[k])
    key = (func, target, regime, tuple(sig))
    got = _cache.get(key)
    if got is None and key not in _cache:
        got = _ask_fake(func, args, kwargs, is_low, target, regime)
        with _lock:
            _cache[key] = got
    if got is not None:
        return got
    return _by_lists(op_name(func), floats, target, regime)


def _by_lists(name: str, floats: list[bool], target: str, regime: str) -> bool:
    """The documented rule where no fake run could answer."""
    promoted = bool(floats) and all(floats)
    if regime == "pure_fp16" or target not in _LISTS:
        return promoted
    lowered, kept_fp32 = _LISTS[target]
    if name in lowered:
        return True
    if name in kept_fp32:
        return False
    return promoted


def _ask_fake(func: Any, args: Sequence[Any], kwargs: dict[str, Any], is_low: Callable[[torch.Tensor], bool],
              target: str, regime: str) -> bool | None:
    """Run ``func`` on fake tensors of the target run's dtypes; whether its output is fp16 (None: it failed)."""
    if op_name(func).endswith("_") or "out" in kwargs:
        return None  # in place: its dtype is its first input's (the caller's rule handles it)
    try:
        # one fake call at a time: catch_warnings saves and restores the process's one filter list, and two
        # threads' overlapping uses would put back each other's (an "ignore" left for good)
        with _fake_lock:
            mode = _fake_mode()
            device = "cuda" if target == "cuda" else "cpu"

            # DisableTorchFunction: the fake calls are not the model's, and no torch function mode
            # (the audit, op capture) may see them.
            with warnings.catch_warnings(), torch._C.DisableTorchFunction():
                warnings.simplefilter("ignore")
                with mode:
                    def fake(obj: Any) -> Any:
                        if isinstance(obj, torch.Tensor):
                            dtype = obj.dtype
                            if obj.is_floating_point():
                                dtype = torch.float16 if is_low(obj) else torch.float32
                            return torch.empty_strided(tuple(obj.shape), tuple(obj.stride()), dtype=dtype,
                                                       device=device)
                        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
                            return type(obj)(fake(v) for v in obj)
                        if isinstance(obj, dict):
                            return {k: fake(v) for k, v in obj.items()}
                        return obj

                    a, k = fake(tuple(args)), fake(dict(kwargs))
                    if regime == "pure_fp16":
                        out = func(*a, **k)
                    else:
                        prev_on, prev_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
                        torch.set_autocast_enabled(device, True)
                        torch.set_autocast_dtype(device, torch.float16)
                        try:
                            out = func(*a, **k)
                        finally:
                            torch.set_autocast_enabled(device, prev_on)
                            torch.set_autocast_dtype(device, prev_dtype)
                            torch.clear_autocast_cache()
        first = _first_float(out)
    except Exception:
        return None
    if first is None:
        return None
    return first in _LOW_DTYPES


def _first_float(obj: Any) -> torch.dtype | None:
    if isinstance(obj, torch.Tensor):
        return obj.dtype if obj.is_floating_point() else None
    if isinstance(obj, (list, tuple)):
        for v in obj:
            got = _first_float(v)
            if got is not None:
                return got
    return None


def _op_cases() -> list[tuple[str, Callable[[Callable[..., torch.Tensor]], Any]]]:
    """(name, run) pairs: ``run(make)`` calls the op on tensors from ``make(shape, low)``."""
    F = torch.nn.functional
    return [
        ("mm", lambda t: torch.mm(t((4, 4), False), t((4, 4), False))),
        ("matmul", lambda t: torch.matmul(t((2, 4, 4), False), t((2, 4, 4), False))),
        ("linear", lambda t: F.linear(t((4, 4), False), t((4, 4), False))),
        ("conv2d", lambda t: F.conv2d(t((1, 2, 4, 4), False), t((2, 2, 3, 3), False))),
        ("bmm", lambda t: torch.bmm(t((2, 4, 4), False), t((2, 4, 4), False))),
        ("baddbmm", lambda t: torch.baddbmm(t((2, 4, 4), False), t((2, 4, 4), False), t((2, 4, 4), False))),
        ("addmm", lambda t: torch.addmm(t((4, 4), False), t((4, 4), False), t((4, 4), False))),
        ("pow", lambda t: t((4, 4), True).pow(2)),
        ("sum", lambda t: t((4, 4), True).sum()),
        ("softmax", lambda t: torch.softmax(t((4, 4), True), -1)),
        ("log_softmax", lambda t: torch.log_softmax(t((4, 4), True), -1)),
        ("layer_norm", lambda t: F.layer_norm(t((4, 4), True), (4,))),
        ("group_norm", lambda t: F.group_norm(t((2, 4, 3), True), 2)),
        ("exp", lambda t: torch.exp(t((4, 4), True))),
        ("log", lambda t: torch.log(t((4, 4), True))),
        ("cumsum", lambda t: torch.cumsum(t((4, 4), True), 0)),
        ("mse_loss", lambda t: F.mse_loss(t((4, 4), True), t((4, 4), True))),
        ("abs", lambda t: t((4, 4), True).abs()),
        ("mean", lambda t: t((4, 4), True).mean()),
        ("add", lambda t: t((4, 4), True) + t((4, 4), True)),
        ("addcmul", lambda t: torch.addcmul(t((4, 4), False), t((4, 4), True), t((4, 4), True))),
        ("cat", lambda t: torch.cat([t((4, 4), True), t((4, 4), False)])),
        # data-dependent output shape: no fake kernel, so the lists answer
        ("ctc_loss", lambda t: F.ctc_loss(t((6, 2, 5), True), torch.tensor([[1, 2], [3, 1]]),
                                          torch.tensor([6, 6]), torch.tensor([2, 2]))),
    ]


def compare_with_device(device: str = "cuda") -> dict[str, Any]:
    """Check the answers this module gives for ``device`` against torch's autocast run there for real.

    Runs each of a list of ops (matmuls, convolutions, reductions, norms, losses, pointwise,
    promotion) on real tensors of ``device`` under fp16 autocast and compares the output's
    dtype with :func:`output_is_low` (the fake-tensor answer, with the documented CUDA lists as
    its fallback). On ``"cuda"`` it needs a GPU (``bench/gpu_check.py`` runs it there); on
    ``"cpu"`` it runs anywhere. Returns ``{"device", "checked", "agree", "disagree": [...]}``.
    """
    rows = [_check_case(name, run, device) for name, run in _op_cases()]
    judged = [r for r in rows if "agree" in r]
    return {"device": device, "torch": torch.__version__, "checked": len(judged),
            "agree": sum(1 for r in judged if r["agree"]), "disagree": [r for r in judged if not r["agree"]],
            "errors": [r for r in rows if "error" in r]}


def _check_case(name: str, run: Callable[[Callable[..., torch.Tensor]], Any], device: str) -> dict[str, Any]:
    """Run one op case for real on ``device`` under autocast and ask :func:`output_is_low` about it."""

    def real(shape: tuple[int, ...], low: bool) -> torch.Tensor:
        x = torch.rand(shape, device=device) + 0.5
        return x.half() if low else x

    try:
        with torch.autocast(device, dtype=torch.float16):
            got = run(real).dtype == torch.float16
    except Exception as e:  # an op the device cannot run: reported, not judged
        return {"op": name, "error": f"{type(e).__name__}: {e}"}
    made: list[torch.Tensor] = []  # kept alive for the case: an id in low_ids is never reused
    low_ids: set[int] = set()

    def is_low(t: torch.Tensor) -> bool:
        return id(t) in low_ids

    def stand_in(shape: tuple[int, ...], low: bool) -> torch.Tensor:
        with torch._C.DisableTorchFunction():  # made outside the op under test
            x = torch.rand(shape) + 0.5  # fp32 on the CPU; is_low says what it would be
        made.append(x)
        if low:
            low_ids.add(id(x))
        return x

    recorded: list[bool] = []

    class _Ask(torch.overrides.TorchFunctionMode):
        """Ask output_is_low about the op the case calls (the last torch call it makes)."""

        def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                recorded.append(output_is_low(func, args, kwargs, is_low, device))
            return out

    with _Ask():
        run(stand_in)
    predicted = recorded[-1] if recorded else None
    return {"op": name, "real_fp16": got, "predicted_fp16": predicted, "agree": predicted is got}


class _SharedPatch:
    """A patch of torch shared by every block that needs it, with a per-thread stack of the blocks' entries.

    Installed once, when the first block starts, and removed when the last one ends (on any thread, in
    any order); a count kept under a lock decides. The entries are kept per thread: a block acts on the
    thread that runs it (the profile, the fp32 rerun), so a training loop on another thread runs as
    written meanwhile. A block that saved and restored torch's functions itself would, when two threads'
    blocks overlap without nesting, put back the other's patch for good.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._local = threading.local()

    def stack(self) -> list[Any]:
        """This thread's entries, outermost block first."""
        found = getattr(self._local, "stack", None)
        if found is None:
            found = self._local.stack = []
        return found

    def _install(self) -> None:
        raise NotImplementedError

    def _remove(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def block(self, entry: Any) -> Iterator[None]:
        """Patched while the block runs, with ``entry`` on this thread's stack."""
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        stack = self.stack()
        stack.append(entry)
        try:
            yield
        finally:
            # by identity: a generator closed out of order (a signal) still takes off its own entry
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is entry:
                    del stack[i]
                    break
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._remove()


class _AutocastPatch(_SharedPatch):
    """``torch.autocast``'s ``__enter__``/``__exit__``, wrapped by this thread's (enter, exit) entries."""

    def __init__(self) -> None:
        super().__init__()
        self._originals: tuple[Any, Any] | None = None

    def _install(self) -> None:
        cls = torch.amp.autocast_mode.autocast
        enter, leave = self._originals = (cls.__enter__, cls.__exit__)
        # Plain functions, so the class binds them to the context as it did its own. They close
        # over the originals: a ``with`` looks ``__exit__`` up as it starts, so a context entered
        # while patched leaves through the patch even after the last block has ended.
        cls.__enter__ = lambda ctx: self._chain(enter, 0)(ctx)  # type: ignore[method-assign]
        cls.__exit__ = lambda ctx, *exc: self._chain(leave, 1)(ctx, *exc)  # type: ignore[method-assign]

    def _remove(self) -> None:
        if self._originals is not None:
            cls = torch.amp.autocast_mode.autocast
            cls.__enter__, cls.__exit__ = self._originals  # type: ignore[method-assign]
            self._originals = None

    def _chain(self, original: Callable[..., Any], index: int) -> Callable[..., Any]:
        """``original`` (``__enter__`` for index 0, ``__exit__`` for 1) under this thread's wrappers, the latest outermost."""
        call = original
        for wrappers in self.stack():
            wrap = wrappers[index]
            if wrap is not None:
                call = functools.partial(wrap, call)
        return call


_PATCH = _AutocastPatch()


@contextlib.contextmanager
def around_autocast(enter: Callable[..., Any] | None = None, exit: Callable[..., Any] | None = None) -> Iterator[None]:
    """Wrap ``torch.autocast``'s ``__enter__`` (``enter(original, ctx)``) and ``__exit__``
    (``exit(original, ctx, *exc)``) for the contexts this thread enters while the block runs.

    The one place the package patches autocast (its subclasses and its decorator form go through
    these two methods): the forward audit notes the contexts entered, the fp32 rerun enters each
    disabled. Blocks nest, and overlap across threads in any order: the class's methods are
    patched while any block runs and are the originals again when the last one ends
    (:class:`_AutocastPatch`); other threads' autocast is left as written.
    """
    with _PATCH.block((enter, exit)):
        yield


# torch's functions that read the autocast state, and the device each reads (None: its argument, "cuda"
# when it is given none, as torch reads it).
_STATE_READERS = {
    "is_autocast_enabled": (None, "enabled"), "get_autocast_dtype": (None, "dtype"),
    "is_autocast_cpu_enabled": ("cpu", "enabled"), "get_autocast_cpu_dtype": ("cpu", "dtype"),
    "get_autocast_gpu_dtype": ("cuda", "dtype"),
}


class _StatePatch(_SharedPatch):
    """torch's autocast-state readers (``torch.is_autocast_enabled`` and kin), answered by this thread's latest
    entry, ``answer(device, what)``, and only for code outside torch and this package: torch's own readers
    (``torch.autocast.__enter__`` saving the state it restores, ``torch.utils.checkpoint`` replaying it in
    backward, ``custom_fwd``) and this package's (the fake-tensor dispatch that switches autocast on and
    back) get the true state, so nothing real is switched on by an answer.
    """

    def __init__(self) -> None:
        super().__init__()
        self._originals: dict[str, Any] = {}

    def _install(self) -> None:
        for name, (device, what) in _STATE_READERS.items():
            original = getattr(torch, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(torch, name, self._reader(original, device, what))

    def _remove(self) -> None:
        for name, original in self._originals.items():
            setattr(torch, name, original)
        self._originals = {}

    def _reader(self, original: Callable[..., Any], device: str | None, what: str) -> Callable[..., Any]:
        def read(*args: Any, **kwargs: Any) -> Any:
            answers = getattr(self._local, "stack", None)
            if answers:
                caller = str(sys._getframe(1).f_globals.get("__name__", "")).partition(".")[0]
                if caller not in _TRUTHFUL:
                    asked = device or str(kwargs.get("device_type", args[0] if args else "cuda"))
                    got = answers[-1](asked, what)
                    if got is not None:
                        return got
            return original(*args, **kwargs)

        read.__wrapped__ = original  # type: ignore[attr-defined]
        read.__doc__ = original.__doc__
        return read


# Code in these packages reads the true state: torch's own, and this package's (which saves and restores it).
_TRUTHFUL = frozenset({"torch", "fp16probe"})

_STATE = _StatePatch()


@contextlib.contextmanager
def answering_autocast_state(answer: Callable[[str, str], Any]) -> Iterator[None]:
    """Answer code outside torch that reads the autocast state, in this thread, with ``answer(device, what)``.

    ``what`` is ``"enabled"`` or ``"dtype"``; ``answer`` returns the value, or None for the true state.
    The emulated step computes in fp32 with autocast off and says what the target run would: a model or
    a loss that reads the state to choose its own precision (a distillation loss cast to the autocast
    dtype, a HF attention casting to ``torch.get_autocast_dtype``) then takes the target run's branch.
    Code that read the state through ``torch._C`` or a name imported before the block is not answered.
    """
    with _STATE.block(answer):
        yield
