"""MoE cases for the GPU tests (``test_gpu_kernels.py``, ``test_gpu_hopper.py``): random weights
and routings on the current CUDA device, inputs as views into NaN-poisoned buffers, the check
against emulation, and a spy on a kernel's launches."""
from __future__ import annotations

import pytest
import torch

from mxfx import formats
from mxfx.backends import emulation
from mxfx.moe_call import ActivationQuant, MoEWeights

moe = pytest.importorskip("mxfx.kernels.moe")
activation = pytest.importorskip("mxfx.kernels.activation")


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def poisoned(t: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """``t`` as a view into a larger CUDA buffer whose extra entries are NaN (0xFF for uint8).
    By default 5 extra per dimension, 16 for uint8 so that MXFP4 rows stay readable as int32
    words (what the Hopper kernel needs; ``pad=5`` sends MXFP4 to the portable kernel)."""
    pad = pad or (16 if t.dtype == torch.uint8 else 5)
    big = torch.empty(*(s + pad for s in t.shape), dtype=t.dtype, device="cuda")
    big.fill_(255 if t.dtype == torch.uint8 else float("nan"))
    view = big[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    return view


def weights(E, H, I, dtype, quantized=True, bias=True, seed=0, transposed=False, pad=0) -> MoEWeights:
    g = gen(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5
    w2 = torch.randn(E, H, I, generator=g, device="cuda") / I**0.5
    b13 = (torch.randn(E, 2 * I, generator=g, device="cuda") * 0.5).to(dtype) if bias else None
    b2 = (torch.randn(E, H, generator=g, device="cuda") * 0.5).to(dtype) if bias else None
    if quantized:
        p13, s13 = formats.quantize(w13, "mxfp4", "round_up")
        p2, s2 = formats.quantize(w2, "mxfp4", "round_up")
        parts = (p13, s13, b13, p2, s2, b2)
    elif transposed:  # K-major storage: stride 1 along N
        parts = (w13.to(dtype).transpose(1, 2).contiguous().transpose(1, 2), None, b13,
                 w2.to(dtype).transpose(1, 2).contiguous().transpose(1, 2), None, b2)
        return MoEWeights(*parts)
    else:
        parts = (w13.to(dtype), None, b13, w2.to(dtype), None, b2)
    return MoEWeights(*(None if p is None else poisoned(p, pad) for p in parts))


def inputs(T, H, E, k, dtype, seed, one_expert=False):
    g = gen(seed)
    x = torch.randn(T, H, generator=g, device="cuda").to(dtype)
    logits = torch.randn(T, E, generator=g, device="cuda")
    tw, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    ids = ids.to(torch.int32)
    if one_expert:
        ids = torch.zeros_like(ids) if k == 1 else ids
    if T > 2:
        ids[1, 0] = -1
        ids[2, :] = -1
    return poisoned(x), tw.to(dtype), ids


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(fn, T, E, H, I, k, dtype, act, aq=ActivationQuant(), tol=5e-3, **kw):
    W = weights(E, H, I, dtype, **{k_: v for k_, v in kw.items() if k_ != "one_expert"})
    x, tw, ids = inputs(T, H, E, k, dtype, seed=T + E, one_expert=kw.get("one_expert", False))
    out = fn(x, tw, ids, W, act, aq)
    ref = emulation.moe(x, tw, ids, W, act, aq)
    assert out.shape == (T, H) and out.dtype == dtype
    assert not out.isnan().any()
    if T:
        assert rel_err(out, ref) <= tol, rel_err(out, ref)
    return out, ref, (x, tw, ids, W)


def spy(monkeypatch, launcher) -> list:
    """The constexprs of each launch through ``launcher``, logged. The class is patched, not
    the instance: undoing an instance patch would leave the old bound method on it."""
    from mxfx.kernels.launch import Launcher

    log, real = [], Launcher._launch

    def spy(self, grid, args, meta):
        if self is launcher:
            log.append(meta)
        return real(self, grid, args, meta)

    monkeypatch.setattr(Launcher, "_launch", spy)
    return log


def unfused(x, tw, ids, W, act, aq):
    return moe.unfused_moe(x, tw, ids, W, act, activation.gated_activation)
