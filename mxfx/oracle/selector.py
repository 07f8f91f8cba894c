"""Choosing a MoE backend: an explicit request is honoured or fails; ``auto`` walks the
platform's priority order and takes the first backend that executes the layer as asked."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from mxfx import backends
from mxfx.oracle import settings
from mxfx.oracle.check import problems
from mxfx.oracle.config import MoEConfig
from mxfx.oracle.decision import Decision, NoBackendError
from mxfx.oracle.platform import Platform

log = logging.getLogger("mxfx")

# Tried in this order by ``auto``; registered third-party backends go first.
PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("triton", "triton_unfused", "emulation"),
    "rocm": ("aiter", "triton", "triton_unfused", "emulation"),
    "xpu": ("triton", "emulation"),
    "cpu": ("emulation",),
}

_cache: dict[tuple, Decision] = {}


def candidates(platform: Platform) -> tuple[str, ...]:
    """The backends ``auto`` tries on ``platform``, in order."""
    return backends.registered() + PRIORITY[platform.kind]


def select(config: MoEConfig, platform: Optional[Platform] = None, backend: str = "auto") -> Decision:
    """The backend that runs ``config`` on ``platform`` (None: this machine).

    ``backend`` (unless "auto") > ``mxfx.configure(moe_backend=...)`` > ``$MXFX_MOE_BACKEND`` >
    auto. A requested backend is used or :class:`NoBackendError` gives its reason; it never
    falls through. Decisions are cached per (config, platform, request, settings) and logged
    once on the ``mxfx`` logger.

    Raises:
        ValueError: ``backend`` (or the setting in force) names no backend.
        NoBackendError: the requested backend, or (auto) every candidate, cannot run it.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected mxfx.oracle.MoEConfig")
    if platform is None:
        platform = Platform.current()
    elif not isinstance(platform, Platform):
        raise TypeError(f"platform: got {type(platform).__name__}, expected mxfx.oracle.Platform or None")
    name, source = settings.requested(backend)
    allow = settings.current().allow_higher_precision_activations
    key = (config, platform, name, source, allow, backends.generation())
    decision = _cache.get(key)
    if decision is None:
        decision = _decide(config, platform, name, source, allow)
        _cache[key] = decision
        if decision.higher_precision:
            log.warning("%s", decision.summary())
        else:
            log.info("%s", decision.summary())
    return decision


def explain(config: MoEConfig, platform: Optional[Platform] = None) -> Decision:
    """What this process would run ``config`` with on ``platform`` (None: this machine), with
    every rejected backend's reason; ``str()`` of the result is a readable table."""
    return select(config, platform)


def clear_cache() -> None:
    """Forget every cached decision (the eager op's too), e.g. after changing ``PRIORITY``."""
    _cache.clear()
    settings.invalidate()


def _decide(config: MoEConfig, platform: Platform, name: str, source: str, allow: bool) -> Decision:
    considered = (name,) if name != "auto" else candidates(platform)
    chosen, executes, rejected = None, None, []
    for candidate in considered:
        backend = backends.get(candidate)
        found = problems(backend, config, platform)
        runs = config.activation_quant if not found else None
        if found and allow and all(field == "activation_quant" for field, _ in found):
            runs = _higher_precision(backend, config, platform)
        if runs is None:
            rejected.append((candidate, "; ".join(reason for _, reason in found)))
        elif chosen is None:
            chosen, executes = backend, runs
    if chosen is None:
        raise NoBackendError(config, platform, name, source, rejected)
    return Decision(
        chosen.name, config, platform, name, source, executes, considered, rejected,
        chosen.capabilities.note,
    )


def _higher_precision(backend, config: MoEConfig, platform: Platform):
    """The nearest higher-precision activation quantization ``backend`` runs exactly, or None."""
    for key in config.activation_quant.higher_precision():
        if not problems(backend, dataclasses.replace(config, activation_quant=key), platform):
            return key
    return None
