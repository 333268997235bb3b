"""The public API is small, explicit and documented: a sorted ``__all__``, every error exported."""

from __future__ import annotations

import inspect

import fp16probe
from fp16probe import errors


def test_all_is_sorted_and_resolves():
    assert list(fp16probe.__all__) == sorted(fp16probe.__all__)
    for name in fp16probe.__all__:
        assert getattr(fp16probe, name) is not None, name


def test_every_error_class_is_exported():
    raised = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.Fp16ProbeError)}
    assert raised <= set(fp16probe.__all__), sorted(raised - set(fp16probe.__all__))

