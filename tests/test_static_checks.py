"""Static checks of the package's source: undefined names, unused or shadowed bindings, and
arguments overwritten by a local (ruff's pyflakes rules and PLR1704).

Why: some code paths run only on a GPU (CUDA-graph capture, NCCL), which the CPU suite cannot reach.
A loop variable that overwrote an argument there (``key`` in ``CUDAGraphTrainStep._capture_first``)
stored every captured graph under the wrong key, and only the GPU run found it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moetune"


def test_package_has_no_undefined_names_or_overwritten_arguments():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F,PLR1704", "--output-format", "concise",
         str(PACKAGE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
