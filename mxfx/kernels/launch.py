"""Low-overhead launches of Triton kernels on CUDA, and host arithmetic for grids.

``kernel[grid](...)`` binds and specializes every argument on each call: about 45 µs of host
time for the MoE GEMM's 43 arguments on the H200 box, of which the compiled kernel's own C
launcher is 11 µs. An eager MoE call makes four launches, so :class:`Launcher` keeps the
compiled kernel per key and calls its C launcher directly (:class:`Direct`), with the argument
list Triton's own launch passes but tensors given as their addresses (the launcher then skips
a ``data_ptr()`` call and a driver query per pointer). The key is finer than what Triton 3.6
specializes a CUDA kernel on (each tensor's dtype and 16-byte alignment; each integer's width,
whether it is 1, whether it is a multiple of 16; constexprs and launch options): it holds the
integers' values themselves, which is cheaper to build than classifying them. So a kernel
taking ``T`` gets an entry per ``T`` seen; the first launch of a key goes through Triton (which
compiles only for a new specialization). :func:`recording` lets :mod:`mxfx.kernels.replay`
capture the direct launches of a whole MoE call to replay them without the launch code.

Elsewhere (the interpreter, ROCm, whose backend also specializes on pointer ranges, or with
Triton launch hooks installed) every launch goes through Triton.

On by default; ``MXFX_FAST_LAUNCH=0`` sends every launch through Triton (and turns the
replay off). ``python tools/profile_moe_eager.py`` measures what this saves.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from typing import Iterator, Optional

import torch
import triton
from triton import knobs


ENABLED = os.environ.get("MXFX_FAST_LAUNCH", "1") != "0"
# Per thread: another thread's launches must not land in a recording.
_local = threading.local()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grid sizes: ``triton.cdiv`` is a JIT callable, about 2 µs a call
    from Python, and an eager MoE call computes a dozen of these."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The SMs of a CUDA device, for grids sized by them (elsewhere, where launches are only
    recorded or compiled, one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context that makes ``t``'s CUDA device the current one, where another is: Triton and
    the direct launches launch on the current device's stream, and callers such as
    transformers' ``device_map`` place layers on other GPUs without switching to them."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def key_and_call(device: int, args: tuple, meta: dict) -> tuple[tuple, list]:
    """What a direct launch is cached on, and the arguments its C launcher takes.

    The key: the device, the constexprs and launch options, each integer as it is, each
    tensor's dtype and whether its address is a multiple of 16 (what Triton 3.6 specializes
    pointers on), the type of anything else (``True`` apart from ``1``). The arguments: the
    same, with tensors as their addresses, so the launcher skips a ``data_ptr()`` call and a
    driver query per pointer (callers have checked the tensors' devices).
    """
    parts: list = [device, *meta.items()]
    call = []
    for a in args:
        kind = type(a)
        if kind is int:
            parts.append(a)
        elif kind is torch.Tensor or isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            parts += (a.dtype, ptr % 16 == 0)
            a = ptr
        elif kind is bool:
            parts += (bool, a)
        else:
            parts.append(kind)
        call.append(a)
    return tuple(parts), call


def direct_launches(t: torch.Tensor) -> bool:
    """Whether launches on ``t``'s device may skip Triton's launch path (CUDA, on, no hooks)."""
    return ENABLED and t.is_cuda and not hooked()


@contextlib.contextmanager
def recording(into: list) -> Iterator[None]:
    """Appends each launch made inside to ``into``: ``(Direct, grid, args, C launcher's
    arguments)``, or None for a launch that went through Triton (see :mod:`mxfx.kernels.replay`)."""
    outer = recorded()
    _local.recording = into
    try:
        yield
    finally:
        _local.recording = outer


def recorded() -> Optional[list]:
    """The list this thread's launches are being recorded into, if any."""
    return getattr(_local, "recording", None)


def hooked() -> bool:
    """Whether launch hooks are installed (Triton 3.6 keeps them in chains, empty by default)."""
    return _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)


def _hooked(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """``Launcher(kernel)[grid](*runtime_args, **constexprs_and_options)``, as ``kernel[grid]``.

    The kernel's constexpr parameters must all follow its runtime parameters, which are
    passed positionally.
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self._kernel = kernel
        self._compiled: dict[tuple, Direct] = {}
        # Under TRITON_INTERPRET=1 the kernel is an interpreted function, always launched as is.
        self._fast = isinstance(kernel, triton.runtime.JITFunction) and torch.version.hip is None
        if self._fast:
            params = list(inspect.signature(kernel.fn).parameters)
            self._constexprs = [p.name for p in kernel.params if p.is_constexpr]
            if params[len(params) - len(self._constexprs):] != self._constexprs:
                raise ValueError(f"kernel {kernel.__name__}: constexpr parameters must come last")

    def constexpr_values(self, meta: dict) -> tuple:
        """The constexprs in signature order: after the runtime arguments, they complete the
        argument list Triton's own launch passes to the compiled kernel."""
        return tuple(meta[name] for name in self._constexprs)

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **meta: self._launch(grid, args, meta)

    def _launch(self, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        first = args[0]
        if not (self._fast and isinstance(first, torch.Tensor) and direct_launches(first)):
            self._kernel[grid](*args, **meta)
            into = recorded()
            if into is not None:
                into.append(None)
            return
        # Triton launches on the current device (as does this, with the same key).
        device = torch.cuda.current_device()
        k, call = key_and_call(device, args, meta)
        direct = self._compiled.get(k)
        if direct is None:
            compiled = self._kernel[grid](*args, **meta)
            direct = self._compiled[k] = Direct(compiled, self.constexpr_values(meta))
        else:
            direct(grid, torch._C._cuda_getCurrentRawStream(device), call)
        into = recorded()
        if into is not None:
            into.append((direct, grid, args, call))


class Direct:
    """A compiled kernel's C launcher, called as Triton's own launch calls it (without the
    Python wrapper around it, unless the kernel needs scratch memory, which that allocates)."""

    def __init__(self, compiled, constexpr_values: tuple) -> None:
        run = compiled.run
        self._head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                      compiled.packed_metadata, None, None, None)
        self._tail = constexpr_values
        self.name = compiled.name
        self._launch = run.launch if not (run.global_scratch_size or run.profile_scratch_size) else None
        self._compiled = compiled

    def __call__(self, grid: tuple[int, ...], stream: int, call: list) -> None:
        g = (*grid, 1, 1)
        if self._launch is None:
            c = self._compiled
            c.run(g[0], g[1], g[2], stream, c.function, c.packed_metadata, None, None, None,
                  *call, *self._tail)
            return
        self._launch(g[0], g[1], g[2], stream, *self._head, *call, *self._tail)
