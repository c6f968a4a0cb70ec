"""Triton's interpreter, as the tests and `validate --device cpu` run requant's kernel: a loop bound
that arrives at run time (`range(0, max_blocks, BLOCKS)` in the prologue's alignment) becomes a
Python int through the tensor's __index__. Triton 3.6's does int() of a 1-element array, which
numpy 2.5 refuses and numpy 2.4 deprecates (made an error here); `_kernels` gives such an
interpreter the __index__ later releases have."""

import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="requant's kernel needs triton (Linux wheels only): pip install 'requant[gpu]'")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from requant.kernels._details import _kernels  # noqa: E402


@triton.jit
def _steps(out_ptr, n, STEP: tl.constexpr):
    total = 0
    for _ in range(0, n, STEP):
        total += 1
    tl.store(out_ptr, total)


def _run_refusing_1_element_int() -> int:
    out = torch.zeros(1, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Conversion of an array with ndim > 0", category=DeprecationWarning)
        _steps[(1,)](out, 10, STEP=4)
    return int(out[0])


def test_runtime_loop_bound_under_triton_3_6s_interpreter(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter is not in use (TRITON_INTERPRET=1 chooses it before triton is imported)")
    current = interpreter._patch_lang_tensor

    def as_triton_3_6(tensor, scope):   # its __index__: int() of the whole array
        current(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", as_triton_3_6)
    with pytest.raises(Exception, match="0-dimensional|ndim > 0"):   # the failure the GPU image showed
        _run_refusing_1_element_int()
    _kernels._interpreter_takes_1_element_bounds()
    assert _run_refusing_1_element_int() == 3
