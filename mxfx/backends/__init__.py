"""The MoE backend registry: builtin names → their modules (imported on first use), plus
backends registered by third parties with :func:`register`.

A builtin backend module exposes its instance as ``BACKEND``. Importing this package imports
no backend module and no kernel.
"""
from __future__ import annotations

import importlib

from mxfx.backends.base import Backend

_BUILTIN = {
    "triton": "mxfx.backends.triton",
    "triton_unfused": "mxfx.backends.triton_unfused",
    "emulation": "mxfx.backends.emulation",
    "aiter": "mxfx.backends.aiter",
}
_loaded: dict[str, Backend] = {}
_registered: dict[str, Backend] = {}
_names: tuple[str, ...] = tuple(_BUILTIN)
_generation = 0


def names() -> tuple[str, ...]:
    """Every backend name: the builtins, then registered ones in registration order."""
    return _names


def registered() -> tuple[str, ...]:
    """The names of third-party backends, in registration order."""
    return tuple(_registered)


def generation() -> int:
    """Changes whenever the set of backends changes (so cached decisions can be dropped)."""
    return _generation


def check_name(name: str, argument: str = "backend") -> None:
    """``ValueError`` naming ``argument`` unless ``name`` is ``"auto"`` or a backend name."""
    if not isinstance(name, str):
        raise TypeError(f"{argument}: got {name!r}, expected 'auto' or a backend name")
    if name != "auto" and name not in _names:
        raise ValueError(f"{argument}: got {name!r}, expected 'auto' or one of {list(_names)}")


def get(name: str) -> Backend:
    """The backend called ``name``; a builtin's module is imported on first use."""
    backend = _loaded.get(name) or _registered.get(name)
    if backend is not None:
        return backend
    check_name(name)
    backend = importlib.import_module(_BUILTIN[name]).BACKEND
    if not isinstance(backend, Backend) or backend.name != name:
        raise TypeError(f"{_BUILTIN[name]}.BACKEND: got {backend!r}, expected a Backend named {name!r}")
    _loaded[name] = backend
    return backend


def register(backend: Backend) -> None:
    """Add a third-party backend. In ``auto`` selection it is tried before the builtins, on
    every platform its capabilities allow; ``backend.name`` must be new."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend: got {backend!r}, expected an instance of mxfx.backends.base.Backend")
    if not backend.name or backend.name == "auto" or backend.name in _names:
        raise ValueError(
            f"backend.name: got {backend.name!r}, expected a new name (taken: {list(_names)})"
        )
    _registered[backend.name] = backend
    _changed()


def unregister(name: str) -> None:
    """Remove a backend added with :func:`register`."""
    if name not in _registered:
        raise ValueError(f"name: got {name!r}, expected a registered backend {list(_registered)}")
    del _registered[name]
    _changed()


def _changed() -> None:
    global _names, _generation
    _names = tuple(_BUILTIN) + tuple(_registered)
    _generation += 1


__all__ = ["Backend", "check_name", "generation", "get", "names", "register", "registered", "unregister"]
