"""The ``interpret`` fixture: tests that run the real Triton kernels on CPU tensors.

Triton's interpreter must be chosen before ``triton`` is imported (``TRITON_INTERPRET=1`` makes
``@triton.jit``, Triton's own library functions included, build interpreted functions), so these
tests only run in a process started with that variable: ``test_interpret_mode.py`` starts one
(``pytest tests/kernels -k interpreter``) whenever Triton is installed. In a normal process they
skip.
"""

from __future__ import annotations

import os

import pytest


def _patch_interpreter_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.x's interpreter turns a scalar into an int with ``int(array)``, which recent NumPy
    refuses for its 1-element arrays, so runtime loop bounds (``range(0, n, step)``) fail in the
    interpreter only (compiled kernels are unaffected). Re-set ``__index__`` after its own patch."""
    import triton.runtime.interpreter as interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # another Triton layout: run unpatched
        return

    def index(self):
        return int(self.handle.data.reshape(-1)[0])

    def patch_lang_tensor(tensor, *scope):  # Triton >= 3.6 passes a scope that undoes the patch
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lets ``impl="triton"`` run the kernels on CPU tensors in Triton's interpreter (slow: tiny shapes)."""
    pytest.importorskip("triton", reason="triton is not installed (optional, GPU-only dependency)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 at process start; test_interpret_mode.py runs these in a subprocess")
    _patch_interpreter_index(monkeypatch)
