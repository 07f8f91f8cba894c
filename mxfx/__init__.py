"""mxfx: fast, correct MXFP4 Mixture-of-Experts layers under ``torch.compile``.

Public API (see the README):

- ``mxfx.ops``: ``torch.ops.mxfx.{quantize_mx, dequantize_mx, gated_activation, moe}``
- ``mxfx.formats``: the OCP MX reference quantizer
"""
from mxfx import formats, ops
from mxfx.activation import GatedActivation

__version__ = "0.1.0"

__all__ = ["GatedActivation", "formats", "ops", "__version__"]
