"""Running the Triton kernels on the CPU: the interpreter, with two of its gaps in triton 3.6 closed.

The interpreter is chosen when a kernel is decorated, so `TRITON_INTERPRET=1` must be set
before `firsttoken.attention.triton_kernels` is imported (tests/cuda/conftest.py does so when
torch sees no CUDA device). Three fixes make it compute what the GPU computes:

- A loop bound loaded from memory is a one-element array, which NumPy >= 2.4 refuses to turn
  into an int (triton-lang/triton#9171, fixed after 3.6): read it with `.squeeze()`.
- bfloat16 is stored as uint16 and `tl.dot` multiplies those bit patterns
  (triton-lang/triton#11584): widen bfloat16 operands to float32 first, which is exact, so the
  product is the GPU's bf16 x bf16 -> fp32 tensor-core product.
- `x.to(tl.bfloat16)` from float32 truncates the mantissa, where the GPU rounds to nearest
  even: convert through torch, which rounds as the GPU does.
"""

from __future__ import annotations

import numpy as np
import torch


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
        if operand.dtype != tl.bfloat16:
            return operand
        widened = (operand.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(widened, tl.float32)

    def create_dot_widening_bfloat16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot_widening_bfloat16

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rounding_to_nearest_even(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    # create_fp_trunc and the other casts call cast_impl through the builder.
    interpreter.InterpreterBuilder.cast_impl = cast_rounding_to_nearest_even
