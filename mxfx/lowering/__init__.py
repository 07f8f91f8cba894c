"""Inductor lowering: rewrites MoE and gated-activation subgraphs into ``mxfx`` ops.

``mxfx.enable()`` installs :data:`PASS` as Inductor's ``post_grad_custom_post_pass``;
:func:`report` lists what the compiles since :func:`clear` rewrote or left alone, and why.
"""
from mxfx.lowering.pass_ import PASS, ComposedPass, LoweringPass, disable, enable, enabled, inductor_options
from mxfx.lowering.report import Record, clear, report

__all__ = [
    "PASS",
    "ComposedPass",
    "LoweringPass",
    "Record",
    "clear",
    "disable",
    "enable",
    "enabled",
    "inductor_options",
    "report",
]
