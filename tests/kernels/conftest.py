"""Fixtures for the kernel tests: running the Triton kernels in Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels import permute, rms_norm, rope, swiglu

KERNEL_MODULES = (rms_norm, swiglu, rope, permute)



def _patch_interpreter_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.x's interpreter turns a scalar tensor into an int with ``int(array)``, which
    NumPy >= 2.? refuses for its 1-element arrays; runtime loop bounds (``range(0, n, step)``)
    then fail in the interpreter only. Re-set ``__index__`` after the interpreter's own patch."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swap every ``@triton.jit`` kernel of moetune.kernels for its interpreted twin, so that
    ``impl="triton"`` runs the real kernel code on CPU tensors (slow: keep shapes tiny)."""
    pytest.importorskip("triton", reason="triton is not installed (it is an optional, GPU-only dependency)")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    _patch_interpreter_index(monkeypatch)
    for module in KERNEL_MODULES:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                monkeypatch.setattr(module, name, InterpretedFunction(obj.fn))
