"""Runs every ``*interpreter*`` kernel test in a subprocess with ``TRITON_INTERPRET=1``.

The interpreter has to be switched on before Triton is imported, which a test cannot do inside
a pytest process that may already have imported it; see conftest.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (optional, GPU-only dependency): no kernel to interpret")

KERNEL_TESTS = Path(__file__).parent
REPO_ROOT = KERNEL_TESTS.parent.parent


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreting: the tests run directly")
def test_kernels_in_triton_interpret_mode():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", str(KERNEL_TESTS), "-q", "-k", "interpreter", "-m", "not gpu",
               "-p", "no:cacheprovider", "--ignore", str(KERNEL_TESTS / "test_compile_sm90.py")]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and " skipped" not in summary, tail  # every interpreter test really ran
