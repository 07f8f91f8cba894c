"""The backend oracle: which backend runs a MoE layer on this platform, and why.

See ``DESIGN.md`` (Oracle). Imports no kernels; backend modules are imported on first use.
"""
from mxfx.oracle.check import supports
from mxfx.oracle.config import MoEConfig
from mxfx.oracle.decision import Decision, NoBackendError
from mxfx.oracle.platform import Platform
from mxfx.oracle.quant import ActivationQuantKey, WeightQuant
from mxfx.oracle.selector import PRIORITY, candidates, clear_cache, explain, select
from mxfx.oracle.settings import configure

__all__ = [
    "ActivationQuantKey",
    "Decision",
    "MoEConfig",
    "NoBackendError",
    "PRIORITY",
    "Platform",
    "WeightQuant",
    "candidates",
    "clear_cache",
    "configure",
    "explain",
    "select",
    "supports",
]
