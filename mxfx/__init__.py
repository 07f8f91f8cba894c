"""mxfx: fast, correct MXFP4 Mixture-of-Experts layers under ``torch.compile``.

Public API (see the README):

- ``mxfx.ops``: ``torch.ops.mxfx.{quantize_mx, dequantize_mx, gated_activation, moe}``
- ``mxfx.formats``: the OCP MX reference quantizer
- ``mxfx.configure(moe_backend=..., allow_higher_precision_activations=...)``, ``mxfx.explain(config)``:
  how MoE backends are chosen (see :mod:`mxfx.oracle`)
- ``mxfx.enable()``, ``mxfx.disable()``, ``with mxfx.enabled():``, ``mxfx.inductor_options()``:
  the Inductor pass that rewrites MoE and gated-activation subgraphs (see :mod:`mxfx.lowering`)
- ``mxfx.quantize_(model)``: a model's experts → MXFP4 storage, in place (see :mod:`mxfx.nn`)
"""
from mxfx import formats, ops
from mxfx import lowering
from mxfx.activation import GatedActivation
from mxfx.lowering import disable, enable, enabled, inductor_options
from mxfx.nn import quantize_
from mxfx.oracle import configure, explain

__version__ = "0.1.0"

__all__ = [
    "GatedActivation", "configure", "disable", "enable", "enabled", "explain", "formats",
    "inductor_options", "lowering", "ops", "quantize_", "__version__",
]
