"""Process-wide oracle settings (``mxfx.configure``) and the request precedence."""
from __future__ import annotations

import os
from dataclasses import dataclass

from mxfx import backends

ENV_BACKEND = "MXFX_MOE_BACKEND"


@dataclass(frozen=True)
class Settings:
    """``moe_backend``: ``"auto"`` or a backend name every MoE layer must use.
    ``allow_higher_precision_activations``: let a backend that does not execute a layer's
    activation quantization run it with higher-precision activations (logged, recorded)."""

    moe_backend: str = "auto"
    allow_higher_precision_activations: bool = False


_current = Settings()
_version = 0


def configure(moe_backend: str = "auto", allow_higher_precision_activations: bool = False) -> None:
    """Set how MoE backends are chosen, for every later decision (eager and compiled).

    Args:
        moe_backend: ``"auto"`` (the oracle chooses per platform and layer) or a backend name,
            which is then used for every layer or the layer fails with that backend's reason.
            An op's own ``backend`` argument overrides it; it overrides ``$MXFX_MOE_BACKEND``.
        allow_higher_precision_activations: if True, a layer whose checkpoint quantizes
            activations (mxfp8/mxfp4) may run on a backend that executes less quantization
            (e.g. bf16 activations). Each such decision is logged at WARNING and recorded.
    """
    global _current
    backends.check_name(moe_backend, "moe_backend")
    if not isinstance(allow_higher_precision_activations, bool):
        raise TypeError(
            f"allow_higher_precision_activations: got {allow_higher_precision_activations!r}, "
            "expected a bool"
        )
    _current = Settings(moe_backend, allow_higher_precision_activations)
    invalidate()


def current() -> Settings:
    return _current


def invalidate() -> None:
    """Change :func:`token`, so that caches keyed by it miss."""
    global _version
    _version += 1


def token() -> tuple:
    """Cheap and hashable; changes whenever a decision could: ``configure``, the environment
    variable, or the set of registered backends."""
    return _version, os.environ.get(ENV_BACKEND), backends.generation()


def requested(backend: str = "auto") -> tuple[str, str]:
    """``(name, source)`` of the backend asked for: ``backend`` unless "auto", else
    ``configure(moe_backend=...)``, else ``$MXFX_MOE_BACKEND``, else ``("auto", "auto")``."""
    if backend != "auto":
        backends.check_name(backend, "backend")
        return backend, "the backend argument"
    if _current.moe_backend != "auto":
        return _current.moe_backend, "mxfx.configure(moe_backend=...)"
    env = os.environ.get(ENV_BACKEND) or "auto"
    if env != "auto":
        backends.check_name(env, ENV_BACKEND)
        return env, ENV_BACKEND
    return "auto", "auto"
