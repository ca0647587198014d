"""Static checks of the package's and the benchmark scripts' source: undefined names, unused or shadowed bindings, and
arguments overwritten by a local (ruff's pyflakes rules and PLR1704).

Why: some code paths run only on a GPU (CUDA-graph capture, NCCL), which the CPU suite cannot reach.
A loop variable that overwrote an argument there (``key`` in ``CUDAGraphTrainStep._capture_first``)
stored every captured graph under the wrong key, and only the GPU run found it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = [ROOT / "moetune", ROOT / "benchmarks"]  # the benchmark scripts run only on the scarce GPU time


def test_source_has_no_undefined_names_or_overwritten_arguments():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F,PLR1704", "--output-format", "concise",
         *map(str, CHECKED)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
