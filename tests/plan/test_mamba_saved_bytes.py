"""``benchmarks/mamba_saved_bytes.py``: the count of what a Mamba-2 block keeps for its backward, the
evidence behind the planner's Nemotron-H activations (benchmarks/results/cpu_20261207_bcf9bbd/)."""

from __future__ import annotations

import re

from tests.conftest import load_benchmark_script


def test_the_count_holds_the_tensors_the_backward_must_have(capsys):
    """Eagerly, at 256 tokens: the block keeps at least the bf16 tensors every Mamba-2 backward needs
    (in_proj's output, the convolution's output, out_proj's input, the normed input), per token the
    same as at any length, and it names the largest tensors."""
    script = load_benchmark_script("mamba_saved_bytes")
    assert script.main(["--seq-len", "256", "--eager", "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    saved, planned = (float(n.replace(",", "")) for n in re.findall(r"([\d,]+) B/token", lines[0]))
    hidden, d_inner, in_proj, conv = 2688, 4096, 10304, 6144  # Nemotron 3 Nano's Mamba-2 widths
    assert saved >= 2 * (in_proj + conv + d_inner + hidden)
    assert planned >= 2 * (in_proj + conv + d_inner + hidden)
    assert len(lines) == 4 and all("B/token" in line for line in lines[1:])
