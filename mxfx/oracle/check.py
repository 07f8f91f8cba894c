"""The one generic capability check: a backend's declared :class:`Capabilities` against a
layer's :class:`MoEConfig` on a :class:`Platform`."""
from __future__ import annotations

from mxfx.backends.base import Backend
from mxfx.oracle.config import MoEConfig
from mxfx.oracle.platform import Platform


def _names(values) -> list[str]:
    return sorted(str(v) for v in values)


def problems(backend: Backend, config: MoEConfig, platform: Platform) -> list[tuple[str, str]]:
    """Every ``(field, reason)`` why ``backend`` cannot run ``config`` on ``platform``; empty if
    it can. ``backend.extra_check`` is asked only when the declared data all fit."""
    caps = backend.capabilities
    out = []
    if platform.kind not in caps.platforms:
        out.append(("platform", f"platform={platform.kind}: runs only on {_names(caps.platforms)}"))
    elif caps.archs is not None and platform.arch not in caps.archs:
        out.append(("arch", f"arch={platform.arch}: needs one of {_names(caps.archs)}"))
    missing = caps.packages - platform.packages
    if missing:
        out.append(("packages", f"packages: needs {_names(missing)}, which do not import here"))
    if config.weight_quant not in caps.weight_quant:
        out.append((
            "weight_quant",
            f"weight_quant={config.weight_quant}: executes only {_names(caps.weight_quant)}",
        ))
    if config.activation_quant not in caps.activation_quant:
        reason = (
            f"activation_quant={config.activation_quant}: executes only "
            f"{_names(caps.activation_quant)}"
        )
        if any(k in caps.activation_quant for k in config.activation_quant.higher_precision()):
            reason += " (would run the layer with higher-precision activations than the checkpoint)"
        out.append(("activation_quant", reason))
    if config.dtype not in caps.dtypes:
        out.append(("dtype", f"dtype={config.dtype}: needs one of {_names(caps.dtypes)}"))
    if config.layout not in caps.layouts:
        out.append(("layout", f"layout={config.layout}: needs one of {_names(caps.layouts)}"))
    if config.has_bias and not caps.bias:
        out.append(("has_bias", "has_bias=True: runs only layers without biases"))
    for field, align in (("hidden_size", caps.hidden_align), ("intermediate_size", caps.intermediate_align)):
        value = getattr(config, field)
        if value % align:
            out.append((field, f"{field}={value}: needs a multiple of {align}"))
    if not out:
        reason = backend.extra_check(config, platform)
        if reason:
            out.append(("extra_check", reason))
    return out


def supports(backend: Backend, config: MoEConfig, platform: Platform) -> tuple[bool, str]:
    """``(True, "")`` if ``backend`` runs ``config`` on ``platform`` exactly as asked, else
    ``(False, reasons)``, each reason naming the field, its value and what was needed."""
    found = problems(backend, config, platform)
    return not found, "; ".join(reason for _, reason in found)
