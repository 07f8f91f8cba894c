"""The Triton gated-activation kernel on a CUDA/ROCm device: bfloat16, model-sized shapes,
dispatch from ``torch.ops.mxfx.gated_activation``, CUDA graphs, no host synchronisation."""
from __future__ import annotations

import pytest
import torch

import mxfx  # noqa: F401  (registers torch.ops.mxfx)
from mxfx import ops
from mxfx.activation import PRESETS, GatedActivation
from mxfx.backends import emulation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device"),
]
kernels = pytest.importorskip("mxfx.kernels.activation")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _x(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_matches_emulation(dtype, preset):
    act = PRESETS[preset]
    shapes = [(1, 2 * 2880), (4096 * 4, 2 * 2880)]
    if dtype == torch.bfloat16:  # odd sizes: tensor-parallel shards, MiniMax-M3, a 3-d input
        shapes += [(513, 2 * 360), (7, 2 * 720), (3, 5, 2 * 3072)]
    for i, shape in enumerate(shapes):
        x = _x(shape, dtype, seed=i)
        out = kernels.gated_activation(x, act)
        torch.testing.assert_close(out, emulation.gated_activation(x, act), equal_nan=True)


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_strided_bf16(layout):
    act = GatedActivation(layout, 1.702, 1.0, 7.0)
    base = _x((300, 4 * 720), torch.bfloat16, seed=5)
    for x in (base[:, ::2], base[::3, 8 : 8 + 2 * 720], base.t()[: 2 * 150].t()):
        out = kernels.gated_activation(x, act)
        assert out.is_contiguous()
        torch.testing.assert_close(out, emulation.gated_activation(x, act))


def test_op_dispatches_to_kernel_for_cuda():
    assert ops._activation_kernel() is kernels
    x = _x((64, 2 * 2880), torch.bfloat16, seed=6)
    out = torch.ops.mxfx.gated_activation(x, "interleaved", 1.702, 1.0, 7.0)
    assert torch.equal(out, kernels.gated_activation(x, PRESETS["gpt_oss"]))
    x64 = x.double()  # not a kernel dtype: the op computes it in torch, in float64
    out64 = torch.ops.mxfx.gated_activation(x64, "interleaved", 1.702, 1.0, 7.0)
    assert torch.equal(out64, emulation.gated_activation(x64, PRESETS["gpt_oss"]))


def test_cuda_graph_and_no_host_sync():
    act = PRESETS["gpt_oss"]
    static_x = _x((128, 2 * 2880), torch.bfloat16, seed=7)
    kernels.gated_activation(static_x, act)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = kernels.gated_activation(static_x, act)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (8, 9):
        fresh = _x((128, 2 * 2880), torch.bfloat16, seed=seed)
        static_x.copy_(fresh)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, emulation.gated_activation(fresh, act))


def test_under_torch_compile():
    # No addition after the op: a cancellation there would magnify a 1-ulp difference between
    # the kernel's and torch's sigmoid.
    def f(x):
        return torch.ops.mxfx.gated_activation(x * 2, "halves", 1.0, 0.0, None) * 3

    x = _x((37, 2 * 1536), torch.bfloat16, seed=10)
    compiled = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(compiled, f(x))  # the same kernel runs in both
    torch.testing.assert_close(compiled, emulation.gated_activation(x * 2, PRESETS["silu_and_mul"]) * 3)
