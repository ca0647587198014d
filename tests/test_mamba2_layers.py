"""moetune's Mamba-2 convolution and chunked scan (``moetune.layers.mamba2``) equal Transformers'
torch path (``mamba2_chunk_scan``, ``causal_conv1d_fn``) in fp32: values and gradients, lengths
that are and are not a multiple of the chunk, and packed documents equal to each document run
alone. On a GPU: bf16 as close to the fp32 reference as Transformers' mixer, no host
synchronisation (captured in a CUDA graph)."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from moetune.layers.mamba2 import causal_conv1d, chunked_scan, document_ids
from tests.conftest import rel_err

# The mixer's gated norm: Transformers 5.10 names it Zamba2RMSNormGated (Zamba2's class), later ones NemotronHRMSNormGated.
GATED_NORM = getattr(hf, "NemotronHRMSNormGated", None) or hf.Zamba2RMSNormGated

needs_transformers_scan = pytest.mark.skipif(
    not hasattr(hf, "mamba2_chunk_scan"),
    reason="Transformers' module-level mamba2_chunk_scan / causal_conv1d_fn (the reference) arrived after 5.10; "
           "5.10's inline torch scan sums the states passed between chunks over the wrong axis",
)

TOL = 1e-5
HEADS, HEAD_DIM, GROUPS, STATE, CHUNK = 8, 4, 2, 6, 16


def _inputs(batch: int, seq_len: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()
    return {
        "x": rand(batch, seq_len, HEADS, HEAD_DIM), "dt": rand(batch, seq_len, HEADS),
        "A": (-torch.rand(HEADS, generator=g) * 2).requires_grad_(),
        "B": rand(batch, seq_len, GROUPS, STATE), "C": rand(batch, seq_len, GROUPS, STATE),
        "D": rand(HEADS), "dt_bias": rand(HEADS),
    }  # fmt: skip


def _transformers_scan(t: dict[str, torch.Tensor], rows=slice(None), span=slice(None)) -> torch.Tensor:
    return hf.mamba2_chunk_scan(
        t["x"][rows, span], t["dt"][rows, span], t["A"], t["B"][rows, span], t["C"][rows, span],
        chunk_size=CHUNK, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True,
    )  # fmt: skip


def _ours(t: dict[str, torch.Tensor], seq_idx=None) -> torch.Tensor:
    return chunked_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=CHUNK, D_H=t["D"],
                        dt_bias_H=t["dt_bias"], seq_idx_BS=seq_idx)


def _probe_weight(like: torch.Tensor) -> torch.Tensor:
    """The loss's weights, from a seeded generator: the same whatever ran before in the process."""
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(7))


def _grads(out: torch.Tensor, t: dict[str, torch.Tensor], weight: torch.Tensor) -> list[torch.Tensor]:
    return torch.autograd.grad((out * weight).sum(), list(t.values()), allow_unused=True)


@needs_transformers_scan
@pytest.mark.parametrize("seq_len", [48, 45, 7])
def test_chunked_scan_equals_transformers(seq_len):
    t = _inputs(2, seq_len)
    ours, ref = _ours(t), _transformers_scan(t)
    assert ours.dtype == torch.float32 and rel_err(ours, ref) < TOL
    weight = _probe_weight(ref)
    for name, got, expected in zip(t, _grads(ours, t, weight), _grads(ref, t, weight)):
        assert rel_err(got, expected) < TOL, name


@needs_transformers_scan
def test_packed_documents_equal_each_document_alone():
    """Row 0 holds three documents (one starts mid-chunk, one crosses a chunk boundary), row 1 one."""
    lengths = [10, 20, 15]
    t = _inputs(2, sum(lengths), seed=1)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]), torch.arange(sum(lengths))])
    ours = _ours(t, seq_idx=document_ids(positions))
    weight = _probe_weight(ours)
    expected_loss = (_transformers_scan(t, rows=slice(1, 2)) * weight[1:]).sum()
    start = 0
    for n in lengths:
        alone = _transformers_scan(t, rows=slice(0, 1), span=slice(start, start + n))
        assert rel_err(ours[:1, start:start + n], alone) < TOL, start
        expected_loss = expected_loss + (alone * weight[:1, start:start + n]).sum()
        start += n
    assert rel_err(ours[1:], _transformers_scan(t, rows=slice(1, 2))) < TOL
    got = torch.autograd.grad((ours * weight).sum(), list(t.values()))
    expected = torch.autograd.grad(expected_loss, list(t.values()))
    for name, g, e in zip(t, got, expected):
        assert rel_err(g, e) < TOL, name


@pytest.mark.parametrize("decay", ["slow", "fast"])
def test_chunked_scan_equals_the_sequential_recurrence(decay):
    """Against the recurrence itself, step by step in float64 (no Transformers involved): slow
    decays carry the state across many chunks (Transformers 5.10's torch scan gets these wrong),
    fast ones test the masked exponentials."""
    g = torch.Generator().manual_seed(4)
    S, R = 37, HEADS // GROUPS
    x, dt = torch.randn(1, S, HEADS, HEAD_DIM, generator=g), torch.randn(1, S, HEADS, generator=g)
    B, C = torch.randn(1, S, GROUPS, STATE, generator=g), torch.randn(1, S, GROUPS, STATE, generator=g)
    A = -torch.rand(HEADS, generator=g) * (0.05 if decay == "slow" else 3.0)
    D = torch.randn(HEADS, generator=g)
    got = chunked_scan(x, dt, A, B, C, chunk_size=CHUNK, D_H=D)
    dt64 = torch.nn.functional.softplus(dt.double())
    state = torch.zeros(HEADS, HEAD_DIM, STATE, dtype=torch.float64)
    for t in range(S):
        B_t, C_t = B[0, t].double().repeat_interleave(R, 0), C[0, t].double().repeat_interleave(R, 0)
        state = (torch.exp(dt64[0, t, :, None, None] * A.double()[:, None, None]) * state
                 + dt64[0, t, :, None, None] * x[0, t].double()[:, :, None] * B_t[:, None, :])
        expected_t = (state * C_t[:, None, :]).sum(-1) + D.double()[:, None] * x[0, t].double()
        assert rel_err(got[0, t], expected_t) < TOL, t


def test_document_ids_restart_at_each_zero_position():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 7, 8, 9, 10]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1]]


@needs_transformers_scan
def test_causal_conv1d_equals_transformers_and_keeps_documents_apart():
    x = torch.randn(2, 30, 12, requires_grad=True)
    weight, bias = torch.randn(12, 4, requires_grad=True), torch.randn(12, requires_grad=True)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), weight, bias).transpose(1, 2)
    assert rel_err(causal_conv1d(x, weight, bias), ref) < TOL
    positions = torch.cat([torch.arange(11), torch.arange(19)]).expand(2, -1)
    got = causal_conv1d(x, weight, bias, seq_idx_BS=document_ids(positions))
    second = hf.causal_conv1d_fn(x[:, 11:].transpose(1, 2), weight, bias).transpose(1, 2)
    assert rel_err(got[:, 11:], second) < TOL and rel_err(got[:, :11], ref[:, :11]) < TOL


def _nano_mixer(device: str, dtype: torch.dtype) -> torch.nn.Module:
    """One Mamba-2 mixer at Nemotron 3 Nano's head layout (fewer heads), moetune's forward."""
    from moetune.models.nemotron_h.model import NemotronHMamba2Mixer

    config = hf.NemotronHConfig(hidden_size=256, mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=128,
                                n_groups=8, chunk_size=128, hybrid_override_pattern="M", num_hidden_layers=1)
    torch.manual_seed(0)
    mixer = hf.NemotronHMamba2Mixer(config, layer_idx=0)
    for param in mixer.parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=0.05)
    mixer.__class__ = NemotronHMamba2Mixer
    return mixer.to(device=device, dtype=dtype).train()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 kernels, graph capture)")
def test_bf16_mixer_on_gpu_is_as_close_to_fp32_as_transformers_and_capturable():
    ours32 = _nano_mixer("cuda", torch.float32)
    ours = _nano_mixer("cuda", torch.bfloat16)
    x = torch.randn(2, 1000, 256, device="cuda")
    with torch.no_grad():
        reference = ours32(x)
        transformers_bf16 = hf.NemotronHMamba2Mixer.forward(ours, x.bfloat16())
        got = ours(x.bfloat16())
    assert rel_err(got.float(), reference) <= max(1e-2, 1.5 * rel_err(transformers_bf16.float(), reference))
    static_x = x.bfloat16().requires_grad_()
    ours(static_x).sum().backward()  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ours(static_x)
        out.float().sum().backward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(static_x.grad).all()


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler (inductor)")
def test_compiled_scan_equals_the_eager_scan():
    """The compiled scan (the default on CUDA) computes what the eager one does: values and
    gradients, with packed documents."""
    from moetune.layers.mamba2 import _chunked_scan, _compiled_scan

    t = _inputs(2, 45, seed=2)
    positions = torch.stack([torch.cat([torch.arange(20), torch.arange(25)]), torch.arange(45)])
    kwargs = dict(chunk_size=CHUNK, D_H=t["D"], dt_bias_H=t["dt_bias"], dt_limit=(0.0, float("inf")),
                  seq_idx_BS=document_ids(positions))
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    eager, compiled = _chunked_scan(*args, **kwargs), _compiled_scan()(*args, **kwargs)
    assert rel_err(compiled, eager) < TOL
    weight = _probe_weight(eager)
    for name, got, expected in zip(t, _grads(compiled, t, weight), _grads(eager, t, weight)):
        assert rel_err(got, expected) < TOL, name


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler (inductor)")
def test_compiled_convolution_with_its_activation_equals_the_eager_one():
    """The convolution + SiLU compiled (the default on CUDA) equals the eager ops and Transformers'
    activation applied after the convolution: values and gradients, with packed documents."""
    from transformers.activations import ACT2FN

    from moetune.layers.mamba2 import _causal_conv1d, _compiled_conv

    torch.manual_seed(0)
    leaves = [torch.randn(2, 30, 12), torch.randn(12, 4), torch.randn(12)]
    seq_idx = document_ids(torch.cat([torch.arange(11), torch.arange(19)]).expand(2, -1))
    outs, grads = [], []
    for conv in (_causal_conv1d, _compiled_conv()):
        inputs = [t.clone().requires_grad_() for t in leaves]
        out = conv(*inputs, seq_idx_BS=seq_idx, activation="silu")
        outs.append(out)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, 12)).sum(), inputs))
    assert rel_err(outs[1], outs[0]) < TOL
    for got, expected in zip(*grads):
        assert rel_err(got, expected) < TOL
    plain = causal_conv1d(leaves[0], leaves[1], leaves[2], seq_idx_BS=seq_idx)
    torch.testing.assert_close(outs[0].detach(), ACT2FN["silu"](plain), rtol=0, atol=0)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler (inductor)")
def test_compiled_gated_norm_equals_transformers_module():
    """The mixer's gated, grouped RMSNorm compiled (the default on CUDA) computes what Transformers'
    module does: values and gradients (input, gate, weight)."""
    from moetune.layers.mamba2 import _compiled_forward

    torch.manual_seed(0)
    norm = GATED_NORM(24, group_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24) + 0.5)
    leaves = [torch.randn(2, 5, 24), torch.randn(2, 5, 24)]
    results = []
    for forward in (type(norm).forward, _compiled_forward(type(norm))):
        inputs = [t.clone().requires_grad_() for t in leaves]
        out = forward(norm, *inputs)
        results.append((out, *torch.autograd.grad((out * torch.linspace(-1, 1, 24)).sum(), [*inputs, norm.weight])))
    for got, expected in zip(results[1], results[0]):
        assert rel_err(got, expected) < TOL
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]  # one graph for every layer's norm, not one per module
    for other in [GATED_NORM(24, group_size=8, eps=1e-5) for _ in range(3)]:
        _compiled_forward(type(other))(other, *(t.clone().requires_grad_() for t in leaves))
    assert counters["stats"]["unique_graphs"] == graphs
