"""The Triton kernels, run by Triton's CPU interpreter, count like the CPU engines.

Skipped where Triton is not installed (it is not a dependency: ``pip install --no-deps triton``
runs these on a CPU-only machine). The shapes are the ones a GPU run meets and a small check
misses: tensors that make each program loop many times (3 * 2^20 + 7 elements over 4
programs), offsets past 2^31 (an address moved back by 2^31 elements), every fp16 bit
pattern binned in the fp16 domain, scaled by a power of two and by another number, and many
tensors of mixed types in one launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECK = r"""
import torch
from fp16probe.capture import _triton_kernel as tk, engine
from tests.test_cpu_kernel import adversarial

torch.manual_seed(0)
engine.CPU_ENGINE = "torch"  # the reference: eager torch ops and bincount
failed = []

def reference(x, inv=None):
    return engine.histogram(x.float() * inv if inv is not None else x)

def check(name, x, inv=None):
    c, k = engine.new_table(3)
    c[0] += 5  # other rows are left alone
    tk.count_into(x, c, k, 1, False, inv)
    rc, rk = reference(x, inv)
    if not (torch.equal(c[1], rc) and int(k[1]) == int(rk) and c[0].sum() == 5 * 281 and c[2].sum() == 0):
        failed.append(name)

every_fp16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
check("fp32 adversarial", adversarial())
check("every fp16 pattern", every_fp16)
for k in (-112, -20, 0, 16, 24, 102, 103, -113):  # the fp16 path's shift range and just past it
    check(f"fp16 / 2^{k}", every_fp16, torch.tensor(2.0**-k))
check("fp16 * 0.3 (not a power of two)", every_fp16, torch.tensor(0.3))
check("bf16", (torch.randn(5000) * 1e-3).to(torch.bfloat16))
check("fp32 scaled", torch.randn(7000) * 1e-3, torch.tensor(2.0**-20))

tk.MAX_PROGRAMS = 4  # each program loops over about 192 tiles
n = 3 * 2**20 + 7
big = (torch.randn(n) * 2.0**-12).half()
big[::4099] = every_fp16[: len(big[::4099])]
check("3*2^20+7 fp16, 4 programs", big)
check("3*2^20+7 fp16 scaled, 4 programs", big, torch.tensor(2.0**-10))
check("3*2^20+7 fp32, 4 programs", big.float() * 1.5)

xs = [torch.randn(5000) * 1e-3, torch.randn(300).half(), torch.randn(40, 30).t(), torch.randn(77).half() * 1e-4,
      torch.empty(0), adversarial(), torch.randn(9000).to(torch.bfloat16)]
rows = [3, 0, 2, 5, 1, 6, 4]
for inv in (None, torch.tensor(2.0**-12)):
    for replace in (False, True):
        c, k = engine.new_table(8)
        c2, k2 = engine.new_table(8)
        earlier = torch.randn(10)
        for table in ((c, k), (c2, k2)):
            engine.count_into(earlier, *table, 3)  # a row already holding counts
        tk.count_many(xs, c, k, rows, replace, inv)
        for x, r in zip(xs, rows):
            engine.count_into(x, c2, k2, r, replace=replace, inv=inv)
        if not (torch.equal(c, c2) and torch.equal(k, k2)):
            failed.append(f"many inv={inv} replace={replace}")

tk.MAX_PROGRAMS = 2
x = (torch.randn(5 * 4096 + 3) * 2.0**-8).half()
for dtype, t in ((torch.float16, x), (torch.float32, x.float())):
    c, k = engine.new_table(1)
    shift = 1 << 31
    tk.launch_many([(t.data_ptr() - shift * t.element_size(), shift, shift + t.numel(), 0)], dtype, c, k)
    rc, rk = reference(t)
    if not (torch.equal(c[0], rc) and int(k[0]) == int(rk)):
        failed.append(f"offsets past 2^31 {dtype}")
print("failed:", failed)
"""


@pytest.mark.slow  # about 30 s: the interpreter runs each program in numpy
def test_triton_kernels_agree_with_the_cpu_engine_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1:] == ["failed: []"], (out.stdout[-2000:], out.stderr[-3000:])
