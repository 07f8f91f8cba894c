"""The Triton gated-activation kernel against the emulation reference.

Runs on the device of the ``kernel_device`` fixture: CPU through ``TRITON_INTERPRET=1`` in CI
(float16/float32 only: the 3.6 interpreter loads bfloat16 wrongly), CUDA on the GPU box.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from mxfx.activation import GPT_OSS, GatedActivation
from mxfx.backends import emulation

kernels = pytest.importorskip("mxfx.kernels.activation")

LIMITS = (None, 0.75, 7.0)


def _x(shape, dtype, device, seed, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def _check(x: torch.Tensor, act: GatedActivation) -> None:
    out = kernels.gated_activation(x, act)
    ref = emulation.gated_activation(x.cpu(), act)
    assert out.dtype == x.dtype and out.device == x.device
    assert out.shape == (*x.shape[:-1], x.shape[-1] // 2)
    assert out.is_contiguous()
    torch.testing.assert_close(out.cpu(), ref, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("limit", LIMITS)
def test_matches_emulation(kernel_device, dtype, layout, limit):
    seed = zlib.crc32(repr((dtype, layout, limit)).encode())
    g = torch.Generator().manual_seed(seed)
    alpha, beta = 0.5 + 2 * torch.rand(1, generator=g).item(), 2 * torch.rand(1, generator=g).item() - 1
    act = GatedActivation(layout, alpha, beta, limit)
    for shape in [(7, 2 * 45), (2, 3, 2 * 37), (1, 2), (33, 2 * 1100)]:
        _check(_x(shape, dtype, kernel_device, seed), act)


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_strided_inputs(kernel_device, layout):
    act = GatedActivation(layout, 1.702, 1.0, 7.0)
    base = _x((24, 2 * 51 * 2), torch.float32, kernel_device, 1)
    _check(base[:, ::2], act)  # last-dim stride 2
    _check(base[::3, 10 : 10 + 2 * 51], act)  # row stride > width, offset start
    _check(_x((2 * 29, 13), torch.float32, kernel_device, 2).t(), act)  # column-major
    _check(_x((4, 2 * 9, 5), torch.float32, kernel_device, 3).permute(2, 0, 1), act)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
def test_nan_and_inf_propagate_like_torch(kernel_device):
    x = _x((3, 2 * 8), torch.float32, kernel_device, 4)
    x[0, 0] = math.nan
    x[1, 3] = math.inf
    x[2, 5] = -math.inf
    for act in (GPT_OSS, GatedActivation("halves", 1.0, 0.0, None), GatedActivation("halves", 1.0, 0.0, 3.0)):
        _check(x, act)


def test_empty(kernel_device):
    x = torch.empty(0, 2 * 5, device=kernel_device)
    assert kernels.gated_activation(x, GPT_OSS).shape == (0, 5)
    assert kernels.gated_activation(torch.empty(3, 0, device=kernel_device), GPT_OSS).shape == (3, 0)


def test_rejects_bad_input(kernel_device):
    x = torch.randn(2, 6, device=kernel_device)
    with pytest.raises(TypeError, match="x: got dtype torch.int32"):
        kernels.gated_activation(x.to(torch.int32), GPT_OSS)
    with pytest.raises(TypeError, match="x: got dtype torch.float64"):
        kernels.gated_activation(x.double(), GPT_OSS)
    with pytest.raises(ValueError, match="last dimension must be even"):
        kernels.gated_activation(x[:, :5], GPT_OSS)
    with pytest.raises(TypeError, match="act: got tuple"):
        kernels.gated_activation(x, ("halves", 1.0, 0.0, None))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("layout", ["interleaved", "halves"])
def test_nan_in_up_and_gate_propagates_through_the_clamp(kernel_device, layout):
    """A NaN in an `up` or a `gate` column comes out NaN under a limit, as torch.clamp keeps
    it, in both layouts (the interpreter's clamp always keeps NaN: this one is for the GPU)."""
    d = 8
    x = torch.randn(2, 2 * d, generator=torch.Generator().manual_seed(0))
    up_col = 1 if layout == "interleaved" else d  # column 0's up
    gate_col = 2 if layout == "interleaved" else 1  # column 1's gate
    x[0, up_col] = float("nan")
    x[1, gate_col] = float("nan")
    act = GatedActivation(layout, 1.702, 1.0, 7.0)
    out = kernels.gated_activation(x.to(kernel_device), act).cpu()
    ref = emulation.gated_activation(x, act)
    assert out[0, 0].isnan() and out[1, 1].isnan()
    torch.testing.assert_close(out, ref, equal_nan=True)
