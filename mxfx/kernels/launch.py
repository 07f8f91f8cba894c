"""Low-overhead launches of Triton kernels on CUDA, and host arithmetic for grids.

``kernel[grid](...)`` binds and specializes every argument on each call: about 45 µs of host
time for the MoE GEMM's 43 arguments on the H200 box, of which the compiled kernel's own C
launcher is 11 µs. An eager MoE call makes four launches, so :class:`Launcher` keeps the
compiled kernel per key and calls its launcher directly, with the argument list Triton's own
launch passes. The key is finer than what Triton 3.6 specializes a CUDA kernel on (each
tensor's dtype and 16-byte alignment; each integer's width, whether it is 1, whether it is a
multiple of 16; constexprs and launch options): it holds the integers' values themselves,
which is cheaper to build than classifying them. So a kernel taking ``T`` gets an entry per
``T`` seen; the first launch of a key goes through Triton (which compiles only for a new
specialization).

Elsewhere (the interpreter, ROCm, whose backend also specializes on pointer ranges, or with
Triton launch hooks installed) every launch goes through Triton.

On by default; ``MXFX_FAST_LAUNCH=0`` sends every launch through Triton. On the H200 box one
eager gpt-oss-120b call at T=1 took 181 µs against 407 µs through Triton (67.7 µs in a CUDA
graph; ``python tools/profile_moe_eager.py``).
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import triton
from triton import knobs


ENABLED = os.environ.get("MXFX_FAST_LAUNCH", "1") != "0"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grid sizes: ``triton.cdiv`` is a JIT callable, about 2 µs a call
    from Python, and an eager MoE call computes a dozen of these."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _spec(arg: Any) -> Any:
    """One argument's part of the key (ints as they are; True must not equal 1 there)."""
    kind = type(arg)
    if kind is int:
        return arg
    if kind is bool:
        return bool, arg
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    return kind


def _hooked() -> bool:
    """Whether launch hooks are installed (Triton 3.6 keeps them in chains, empty by default)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class Launcher:
    """``Launcher(kernel)[grid](*runtime_args, **constexprs_and_options)``, as ``kernel[grid]``.

    The kernel's constexpr parameters must all follow its runtime parameters, which are
    passed positionally.
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self._kernel = kernel
        self._compiled: dict[tuple, tuple] = {}
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
        x = next(a for a in args if isinstance(a, torch.Tensor))
        if not (ENABLED and self._fast) or x.device.type != "cuda" or _hooked():
            self._kernel[grid](*args, **meta)
            return
        # Triton launches on the current device (as does this, with the same key).
        device = torch.cuda.current_device()
        key = (tuple(meta.items()), device, *[_spec(a) for a in args])
        hit = self._compiled.get(key)
        if hit is None:
            compiled = self._kernel[grid](*args, **meta)
            self._compiled[key] = (compiled, self.constexpr_values(meta))
            return
        compiled, constexpr_values = hit
        g = (*grid, 1, 1)
        compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device),
                     compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *constexpr_values)
