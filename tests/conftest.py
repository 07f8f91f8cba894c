"""Shared test helpers.

- Without CUDA, Triton kernels run in the interpreter: Triton 3.6 reads ``TRITON_INTERPRET``
  when ``@triton.jit`` decorates (i.e. when a ``mxfx.kernels`` module is first imported), so it
  is set here, before any test module imports a kernel.
- ``kernel_device``: where kernel tests build their inputs ("cuda", or "cpu" = interpreter).
- ``mx_ref_dequantize``: an MX decoder written from the OCP MX v1.0 spec, independent of
  ``mxfx.formats``, so tests can check mxfx against code it does not share.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kernel_device() -> str:
    pytest.importorskip("triton")
    return "cuda" if torch.cuda.is_available() else "cpu"


# OCP MX v1.0 E2M1 magnitudes by code; bit 3 of a code is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _ref_dequantize(packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """MX ``(packed, scales)`` → float64 ``[..., K]``; E8M0 byte b is 2^(b-127), 0xFF is NaN."""
    if fmt == "mxfp4":
        b = packed.to(torch.int64)
        codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # element 2i: low nibble
        table = torch.tensor(
            E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=torch.float64
        )
        values = table[codes]
    else:
        values = packed.to(torch.float64)  # float8 → float64 is exact
    exps = scales.to(torch.float64) - 127
    scale = torch.where(scales == 0xFF, torch.nan, torch.exp2(exps))
    blocks = values.unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)
    return blocks.flatten(-2)


@pytest.fixture(scope="session")
def mx_ref_dequantize():
    """``f(packed, scales, fmt) -> float64 tensor``: the spec's decoder, not mxfx's."""
    return _ref_dequantize
