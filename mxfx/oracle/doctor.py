"""``python -m mxfx doctor``: this platform and the backend chosen for well-known layers."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

import mxfx
from mxfx.oracle import settings
from mxfx.oracle.decision import NoBackendError
from mxfx.oracle.platform import Platform
from mxfx.oracle.quant import ActivationQuantKey
from mxfx.oracle.selector import candidates, select
from mxfx.oracle.shapes import SHAPES


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def report(platform: Optional[Platform] = None) -> str:
    """The doctor's text for ``platform`` (None: this machine)."""
    simulated = platform is not None
    platform = platform or Platform.current()
    s = settings.current()
    lines = [
        f"mxfx {mxfx.__version__}",
        f"platform: {platform}{' (simulated)' if simulated else ''}",
        f"torch {torch.__version__}, triton {_triton_version()}",
        f"settings: moe_backend={s.moe_backend!r}, "
        f"allow_higher_precision_activations={s.allow_higher_precision_activations}, "
        f"{settings.ENV_BACKEND}={os.environ.get(settings.ENV_BACKEND)!r}",
        f"auto tries, in order: {', '.join(candidates(platform))}",
    ]
    if platform.kind == "cpu":
        lines.append("(to see a GPU's choices: python -m mxfx doctor --platform rocm:gfx950)")
    for model, shape in SHAPES.items():
        lines += ["", f"{model}: {str(shape).rsplit(' A=', 1)[0]}"]
        for aq in ActivationQuantKey:
            config = dataclasses.replace(shape, activation_quant=aq)
            try:
                decision = select(config, platform)
            except NoBackendError as e:
                chosen, rejected = "NO BACKEND", e.rejected
            except ValueError as e:  # a bad MXFX_MOE_BACKEND
                chosen, rejected = f"ERROR: {e}", []
            else:
                chosen, rejected = decision.backend, decision.rejected
                if decision.higher_precision:
                    chosen += f" (runs activations as {decision.activation_quant}: higher precision)"
            lines.append(f"  A={aq.value:<5} -> {chosen}")
            lines += [f"      {name}: {reason}" for name, reason in rejected]
    return "\n".join(lines)
