"""Running the Triton kernels on the CPU: the interpreter, with its gaps in triton 3.6 closed.

The interpreter is chosen when a kernel is decorated, so `TRITON_INTERPRET=1` must be set
before `firsttoken.attention.triton_kernels` is imported (tests/cuda/conftest.py does so when
torch sees no CUDA device). Four fixes make it compute what the GPU computes:

- A loop bound loaded from memory is a one-element array, which NumPy >= 2.4 refuses to turn
  into an int (triton-lang/triton#9171, fixed after 3.6): read it with `.squeeze()`.
- bfloat16 is stored as uint16 and `tl.dot` multiplies those bit patterns
  (triton-lang/triton#11584): widen bfloat16 (and float16) operands to float32 first, which is
  exact, so the product is the GPU's 16-bit x 16-bit -> fp32 tensor-core product.
- `tl.dot` is `np.matmul`, whose BLAS kernels sum a row's products in an order that depends on
  the row's place in the tile (a row moved five rows down changes its bits), where a tensor
  core computes every row of a tile alike: sum each output's products in K order instead, so
  a row's result depends on its own operands only, as the batch-invariant kernels assume.
- `x.to(tl.bfloat16)` from float32 truncates the mantissa, where the GPU rounds to nearest
  even: convert through torch, which rounds as the GPU does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

# The marks of a case the interpreter takes long over and whose features cheaper cases of the same
# test cover: the slow tier's without a GPU; on a GPU every case runs by default.
SLOW_ON_CPU = [] if torch.cuda.is_available() else [pytest.mark.slow]


def patch_interpreter() -> None:
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_scalar_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_tensor_with_scalar_index

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(operand):
        if operand.dtype == tl.float16:
            return interpreter.TensorHandle(operand.data.astype(np.float32), tl.float32)
        if operand.dtype != tl.bfloat16:
            return operand
        widened = (operand.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(widened, tl.float32)

    def create_dot_row_by_row(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = widen(a), widen(b)
        if a.dtype != tl.float32 or b.dtype != tl.float32 or d.data.dtype != np.float32:
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        # [..., M, K, N] products, summed over K one slice at a time: the same order for every row.
        products = a.data[..., :, :, None] * b.data[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2, dtype=np.float32) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot_row_by_row

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rounding_to_nearest_even(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    # create_fp_trunc and the other casts call cast_impl through the builder.
    interpreter.InterpreterBuilder.cast_impl = cast_rounding_to_nearest_even
