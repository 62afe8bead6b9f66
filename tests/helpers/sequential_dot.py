"""The Triton interpreter's ``tl.dot`` in the summation order with the largest worst-case error
(not a test module; ``MEGAFLEX_TEST_SEQUENTIAL_DOT=1`` makes tests/conftest.py install it).

The interpreter does its dots with numpy's OpenBLAS, whose kernels (hence rounding) differ per CPU
family; the second numerics pass of tests/run.sh tries one other family, but only the families
this CPU can execute (AVX-512 kernels raise SIGILL without AVX-512). This replaces every dot by a
sequential sum over K in the accumulator's precision with a rounding after each multiply and each
add (no FMA, no blocking): Higham's gamma_K bound is attained by this order, so a tolerance that
holds here holds for any BLAS's order. About 2x slower than OpenBLAS on the Triton tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def install() -> None:
    """Patch ``InterpreterBuilder.create_dot`` (fp8 operands keep the original)."""
    import triton.runtime.interpreter as interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.data.dtype.itemsize == 1 or b.data.dtype.itemsize == 1:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc_type = d.data.dtype
        lhs, rhs = a.data.astype(acc_type), b.data.astype(acc_type)
        acc = np.broadcast_to(d.data, lhs.shape[:-1] + rhs.shape[-1:]).astype(acc_type)
        for k in range(lhs.shape[-1]):
            acc = acc + (lhs[..., :, k : k + 1] * rhs[..., k : k + 1, :]).astype(acc_type)
        return interpreter.TensorHandle(acc.astype(acc_type), d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
