"""Model entry points: MXFP4 expert storage, ``quantize_`` and MXFP4 checkpoint loading.

See :mod:`mxfx.nn.experts` for the experts protocol that mxfx converts.
"""
from mxfx.nn.checkpoint import LoadedLayer, empty_parameters, load_mxfp4_checkpoint
from mxfx.nn.experts import MXFP4Experts, expert_activation, is_experts_module, to_mxfp4
from mxfx.nn.quantize import QuantizeReport, quantize_

__all__ = [
    "LoadedLayer",
    "MXFP4Experts",
    "QuantizeReport",
    "empty_parameters",
    "expert_activation",
    "is_experts_module",
    "load_mxfp4_checkpoint",
    "quantize_",
    "to_mxfp4",
]
