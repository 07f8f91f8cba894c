"""Launch plans: a host function's kernel launches recorded once per signature, then replayed.

At small T an eager MoE call is bound by its host time: for every call the launch code picks
configs, computes grids and strides, allocates a handful of temporaries and builds each
launch's key and argument list. All of that depends only on the inputs' dtypes, shapes,
strides, devices and 16-byte alignment. So :class:`Replayer` runs its function once per such
signature while recording what it does on the device: its allocations, its views and its
launches through :class:`mxfx.kernels.launch.Launcher`. If that is all it does (any other
aten op, a copy, a fill or a read back to the host, leaves the signature unplanned: later
calls run the function), later calls allocate the same temporaries in one workspace and the
output, then call the same compiled kernels with the new addresses patched into the
recorded argument lists. Temporaries whose launches do not overlap share workspace bytes
(the launches run in stream order), so the workspace is the most that is live at once, not
the sum of everything the function allocated.

Only where :class:`~mxfx.kernels.launch.Launcher` launches directly (CUDA, no launch hooks,
``MXFX_FAST_LAUNCH`` not 0); elsewhere the function always runs.
"""
from __future__ import annotations

from typing import Callable, Hashable, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mxfx.kernels import launch
from mxfx.moe_call import signature

_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
_ALIGN = 256  # bytes between temporaries in the workspace, as the caching allocator's
_UNSEEN = object()


class _Watch(TorchDispatchMode):
    """Keeps every allocation made under it (alive, so no address is reused) and notes whether
    any op other than an allocation or a view ran."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[torch.Tensor] = []
        self.other: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocations.append(out)
        elif not func.is_view and self.other is None:
            self.other = str(func)
        return out


class _Launch(NamedTuple):
    direct: launch.Direct
    grid: tuple[int, ...]
    args: list  # the C launcher's arguments, addresses to be patched in
    patches: tuple[tuple[int, int, int], ...]  # (position, base, byte offset from it)


class _Region(NamedTuple):
    """A temporary in the workspace: its bytes, the first and last launch that use it, where."""
    nbytes: int
    first: int
    last: int
    offset: int


class _Plan(NamedTuple):
    device: torch.device
    workspace: int  # bytes
    regions: tuple[_Region, ...]
    out: tuple[tuple[int, ...], tuple[int, ...], torch.dtype]  # size, stride, dtype
    launches: tuple[_Launch, ...]


def _plan(inputs: tuple, out: torch.Tensor, watch: _Watch, launches: list) -> _Plan | str:
    """The recorded call as a plan, or why it cannot be one."""
    if watch.other is not None:
        return f"it ran {watch.other}"
    if not all(launches):
        return "a launch went through Triton"
    out_ptr = out.data_ptr()
    if out.storage_offset() or not any(a.data_ptr() == out_ptr for a in watch.allocations):
        return "its output is not a tensor it allocated"
    sizes = {a.data_ptr(): a.untyped_storage().nbytes() for a in watch.allocations
             if a.data_ptr() not in (0, out_ptr)}
    spans: dict[int, list[int]] = {}  # temporary's address -> [first, last] launch using it
    addresses = [None if t is None else t.data_ptr() for t in inputs]
    ws, out_base = len(inputs), len(inputs) + 1
    steps = []
    for i, (direct, grid, args, call) in enumerate(launches):
        patches = []  # (position, base, temporary's address or None, byte offset)
        for pos, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            ptr = a.data_ptr()
            found = [j for j, p in enumerate(addresses) if p == ptr]
            if len(found) == 1:
                patches.append((pos, found[0], None, 0))
            elif not found and ptr == out_ptr:
                patches.append((pos, out_base, None, 0))
            elif not found:
                hit = [start for start, n in sizes.items() if start <= ptr < start + n]
                if not hit:
                    return f"argument {pos} of {direct.name} is not an input, a temporary or the output"
                spans.setdefault(hit[0], [i, i])[1] = i
                patches.append((pos, ws, hit[0], ptr - hit[0]))
            else:
                return f"argument {pos} of {direct.name} is the address of several inputs"
        steps.append((direct, grid, call, patches))
    regions = _pack({start: (sizes[start], first, last) for start, (first, last) in spans.items()})
    plan = tuple(_Launch(direct, grid, call, tuple((pos, base, offset + (0 if t is None else regions[t].offset))
                                                    for pos, base, t, offset in patches))
                 for direct, grid, call, patches in steps)
    size = max((r.offset + r.nbytes for r in regions.values()), default=0)
    return _Plan(out.device, size, tuple(regions.values()), (tuple(out.shape), out.stride(), out.dtype), plan)


def _pack(spans: dict[int, tuple[int, int, int]]) -> dict[int, _Region]:
    """Workspace regions for temporaries (key -> bytes, first and last launch using it): the
    largest first, each at the lowest aligned offset clear of every region already placed
    whose launches overlap its own."""
    regions: dict[int, _Region] = {}
    for key, (nbytes, first, last) in sorted(spans.items(), key=lambda kv: (-kv[1][0], kv[1][1])):
        offset = 0
        for r in sorted(regions.values(), key=lambda r: r.offset):
            if r.first <= last and first <= r.last and r.offset + r.nbytes > offset:
                if offset + nbytes <= r.offset:
                    break
                offset = -(-(r.offset + r.nbytes) // _ALIGN) * _ALIGN
        regions[key] = _Region(nbytes, first, last, offset)
    return regions


class Replayer:
    """``Replayer(fn)(tensors, static)`` is ``fn(*tensors, *static)``, replayed from a plan
    where one exists. ``tensors``: the function's tensor inputs (or None), all on one device,
    which the call makes current where it is not; ``static``: its other arguments, hashable.
    ``fn`` must return one newly allocated tensor. The plans are per
    :func:`~mxfx.moe_call.signature` of ``tensors`` and ``static``, or per ``key``, where
    the caller has one that is equal exactly when those are."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self._fn = fn
        # A plan per signature seen, or why there is none.
        self._plans: dict[tuple, _Plan | str] = {}

    def __call__(self, tensors: tuple, static: tuple, key: Optional[Hashable] = None) -> torch.Tensor:
        first = tensors[0]
        if not launch.direct_launches(first):
            with launch.on_device(first):
                return self._fn(*tensors, *static)
        device = torch.cuda.current_device()
        if first.is_cuda and first.get_device() != device:
            with torch.cuda.device(first.device):
                return self(tensors, static, key)
        key = (device, (signature(tensors), *static) if key is None else key)
        plan = self._plans.get(key, _UNSEEN)
        if plan is _UNSEEN:
            return self._record(key, tensors, static)
        if type(plan) is str:
            return self._fn(*tensors, *static)
        bases: list = [0 if t is None else t.data_ptr() for t in tensors]
        if plan.workspace:
            workspace = torch.empty(plan.workspace, dtype=torch.uint8, device=plan.device)
            bases.append(workspace.data_ptr())
        else:
            bases.append(0)
        size, stride, dtype = plan.out
        out = torch.empty_strided(size, stride, dtype=dtype, device=plan.device)
        bases.append(out.data_ptr())
        stream = torch._C._cuda_getCurrentRawStream(device)
        for step in plan.launches:
            call = step.args.copy()
            for pos, base, offset in step.patches:
                call[pos] = bases[base] + offset
            step.direct(step.grid, stream, call)
        return out

    def _record(self, key: tuple, tensors: tuple, static: tuple) -> torch.Tensor:
        launches: list = []
        watch = _Watch()
        with launch.recording(launches), watch:
            out = self._fn(*tensors, *static)
        self._plans[key] = _plan(tensors, out, watch, launches)
        return out
