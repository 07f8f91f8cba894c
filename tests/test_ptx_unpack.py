"""The PTX MXFP4 unpacks of :mod:`mxfx.kernels.mx` and :mod:`mxfx.kernels.sm90_tile` on CPU,
through a small interpreter of the instructions they use (mov, and, shifts, prmt, lop3, integer
multiply-add and max, mul.rn.bf16x2) on numpy arrays:

- the PTX text alone against :func:`mxfx.formats.dequantize`, every nibble and edge scale;
- plugged into the Triton interpreter (which cannot run inline assembly), the kernels' whole
  PTX path: int32 word loads, the join of the unpacked words back into K order or halves,
  in ``dequantize_mxfp4`` and the MoE GEMMs of every tile regime.

The GPU tests run the same text on the H200; these catch a wrong selector or order without one.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mxfx import formats
from mxfx.activation import GPT_OSS
from mxfx.backends import emulation
from mxfx.moe_call import ActivationQuant, MoEWeights

triton = pytest.importorskip("triton")
from mxfx.kernels import moe, mx, sm90_tile  # noqa: E402

U32 = np.uint32


def _prmt(a, b, c):
    """Default-mode prmt.b32: byte i of the result is byte (c's nibble i & 7) of {b, a}, or
    that byte's sign replicated when the nibble's bit 3 is set."""
    src = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, c).shape, dtype=U32)
    for i in range(4):
        sel = (c >> U32(4 * i)) & U32(0xF)
        byte = ((src >> ((sel & U32(7)).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(U32)
        byte = np.where(sel & U32(8), np.where(byte & U32(0x80), U32(0xFF), U32(0)), byte)
        out |= byte << U32(8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros(np.broadcast(a, b, c).shape, dtype=U32)
    for idx in range(8):
        if (int(lut) >> idx) & 1:
            out |= (a if idx & 4 else ~a) & (b if idx & 2 else ~b) & (c if idx & 1 else ~c)
    return out


def _mul_bf16x2(a, b):
    out = np.zeros(np.broadcast(a, b).shape, dtype=U32)
    for sh in (U32(0), U32(16)):
        x = (((a >> sh) & U32(0xFFFF)) << U32(16)).view(np.float32)
        y = (((b >> sh) & U32(0xFFFF)) << U32(16)).view(np.float32)
        # Exact in float32 (few mantissa bits), then one rounding, as mul.rn.bf16x2.
        prod = torch.from_numpy(np.ascontiguousarray(x * y)).to(torch.bfloat16).view(torch.int16).numpy()
        out |= (prod.astype(np.int32).astype(U32) & U32(0xFFFF)) << sh
    return out


_OPS = {
    "mov.b32": lambda v: v[0],
    "and.b32": lambda v: v[0] & v[1],
    "shr.b32": lambda v: v[0] >> v[1],
    "shr.u32": lambda v: v[0] >> v[1],
    "shl.b32": lambda v: v[0] << v[1],
    "mad.lo.u32": lambda v: v[0] * v[1] + v[2],
    "max.u32": lambda v: np.maximum(v[0], v[1]),
    "mul.lo.u32": lambda v: v[0] * v[1],
    "prmt.b32": lambda v: _prmt(*v),
    "lop3.b32": lambda v: _lop3(*v),
    "mul.rn.bf16x2": lambda v: _mul_bf16x2(*v),
}


def run_ptx(text: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the straight-line PTX body elementwise on uint32 arrays; returns every register."""
    regs = {k: np.asarray(v).astype(U32) for k, v in inputs.items()}
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op not in _OPS:
            raise AssertionError(f"instruction not modelled: {line}")
        args = [U32(int(t, 0)) if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", t) else regs[t] for t in src]
        regs[dst] = np.asarray(_OPS[op](args)).astype(U32)
    return regs


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return (x.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int32) & 0xFFFF).astype(U32)


@pytest.mark.parametrize("name", ["_PTX_PAIRS", "_PTX_HALVES", "moe_sm90", "moe_sm90_split", "moe_sm90_split_small"])
def test_ptx_text_matches_formats(name):
    g = torch.Generator().manual_seed(0)
    n = 1024
    packed = torch.randint(0, 256, (n, 16), generator=g, dtype=torch.uint8)
    packed[:16, :4] = (torch.arange(16, dtype=torch.uint8) * 17)[:, None]  # every nibble value
    small = name == "moe_sm90_split_small"  # exact for scales up to 128 only
    scales = torch.randint(0, 129 if small else 256, (n, 1), generator=g, dtype=torch.uint8)
    scales[:4, 0] = torch.tensor([0, 128, 1, 127] if small else [0, 255, 1, 254], dtype=torch.uint8)
    # A word's 4 bytes lead a 32-block: the kernels give a word one scale.
    ref = _bf16_bits(formats.dequantize(packed, scales, "mxfp4", torch.bfloat16)[:, :8])
    word = packed[:, :4].contiguous().view(torch.int32).numpy()[:, 0].view(U32)
    s = scales[:, 0].numpy().astype(U32)
    if name == "moe_sm90":  # the scale byte itself, and the two table words the kernel passes
        out = run_ptx(sm90_tile.UNPACK.value, {"$4": word, "$12": s, "$20": U32(0xC0800000), "$28": U32(0x40403F00)})
    elif name == "moe_sm90_split":  # the scale byte, and 2^126 in both bf16 halves
        out = run_ptx(sm90_tile.UNPACK_SPLIT.value, {"$4": word, "$12": s, "$20": U32(0x7E807E80)})
    elif small:
        out = run_ptx(sm90_tile.UNPACK_SPLIT_SMALL.value, {"$4": word, "$12": s})
    else:
        sb = np.where(s == 0, U32(0x40), np.where(s == 255, U32(0x7FC0), s << U32(7)))
        out = run_ptx(getattr(mx, name).value, {"$4": word, "$5": sb | (sb << U32(16))})
    got = np.stack([(out[f"${i}"] >> U32(sh)) & U32(0xFFFF) for i in range(4) for sh in (0, 16)], axis=1)
    # Pairs: $i = elements 2i, 2i+1; halves: $0, $1 = even elements of bytes 0-1, 2-3, then odd;
    # split: $i = elements i, i + 4.
    order = {"_PTX_HALVES": [0, 2, 4, 6, 1, 3, 5, 7], "moe_sm90_split": [0, 4, 1, 5, 2, 6, 3, 7],
             "moe_sm90_split_small": [0, 4, 1, 5, 2, 6, 3, 7]}
    want = ref[:, order.get(name, range(8))]
    nan = ((want & 0x7F80) == 0x7F80) & ((want & 0x7F) != 0)
    assert ((got & 0x7F80) == 0x7F80)[nan].all() and ((got & 0x7F) != 0)[nan].all()  # NaN stays NaN
    np.testing.assert_array_equal(got[~nan], want[~nan])


def test_split_unpack_order_is_the_activations_order():
    """The mma.sync path re-pairs the activations by ``sm90_tile.SPLIT_PERM`` (grouped blocks,
    in registers) or stores them at ``sm90_tile.paired_position`` (per-pair blocks' rows): each
    must put an element where :data:`sm90_tile.UNPACK_SPLIT` puts that element's weight (the
    Gluon kernels run only on the GPU; this catches a mismatch without one)."""
    perm = sm90_tile.SPLIT_PERM.value
    assert perm[:4] == [0, 1, 2, 3] and sorted(perm[4:]) == [4, 5, 6]
    for n in range(8):
        word = U32(2 << (4 * n))  # element n = 1.0, the others 0
        out = run_ptx(sm90_tile.UNPACK_SPLIT.value, {"$4": np.array([word]), "$12": np.array([127]),
                                                     "$20": U32(0x7E807E80)})
        got = [i for i in range(8) if (out[f"${i // 2}"][0] >> U32(16 * (i % 2))) & U32(0xFFFF)]
        bits = [(n >> 2) & 1, (n >> 1) & 1, n & 1]  # dims 4, 5, 6 of the natural view
        want = sum(bits[perm[4 + d] - 4] << (2 - d) for d in range(3))
        assert got == [want], (n, got, want)
        assert sm90_tile.paired_position.fn(n + 8) == 8 + want, n


def test_dot_position_is_the_step_permutation():
    """Two encodings of the dot's K order: ``sm90_tile.dot_position`` (offsets, where GEMM1's
    epilogue stores the intermediate and moe_sm90 reads dot-ordered activations) and
    ``sm90_tile.step_permutation`` (axes, by which ``moe_sm90_ws.dot_order`` permutes x). Both
    orders, split (``dot_position``'s SPLIT: after ``paired_position``) and not, must agree."""
    k = torch.arange(128)
    for split in (False, True):
        at = torch.arange(128).reshape(1, 4, 4, 2, 2, 2).permute(sm90_tile.step_permutation(split)).reshape(128)
        pos = sm90_tile.dot_position.fn(sm90_tile.paired_position.fn(k) if split else k, False)
        assert torch.equal(at[pos], k), split


@pytest.fixture
def ptx_in_interpreter(monkeypatch):
    """The Triton interpreter running inline PTX through :func:`run_ptx`; the kernels take
    their PTX path on CPU tensors."""
    from triton.runtime import interpreter

    if not hasattr(interpreter, "InterpreterBuilder"):
        pytest.skip("needs the Triton interpreter")

    class _Call:
        def __init__(self, results):
            self._results = results

        def get_result(self, i):
            return self._results[i]

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        assert pack == 1, "the emulation handles one element per instance"
        n_out = constraints.count("=")
        ins = {f"${n_out + j}": v.data.view(U32) for j, v in enumerate(values)}
        regs = run_ptx(asm, ins)
        return _Call([interpreter.TensorHandle(regs[f"${i}"].view(np.int32), ty.scalar)
                      for i, ty in enumerate(types)])

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", create_inline_asm, raising=False)
    monkeypatch.setattr(mx, "ptx_unpack", lambda dtype, device: True)


def test_dequantize_kernel_ptx_path(ptx_in_interpreter):
    if torch.cuda.is_available():
        pytest.skip("the GPU tests run the PTX itself")
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 256, (5, 48), generator=g, dtype=torch.uint8)
    s = torch.randint(100, 150, (5, 3), generator=g, dtype=torch.uint8)
    s[0, 0], s[1, 1] = 0, 255
    got = mx.dequantize_mxfp4(p, s, torch.bfloat16)
    torch.testing.assert_close(got, formats.dequantize(p, s, "mxfp4", torch.bfloat16), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("T", [3, 40, 150])  # the three tile regimes of pick_config at E=4, k=2
def test_moe_ptx_path(ptx_in_interpreter, T):
    if torch.cuda.is_available():
        pytest.skip("the GPU tests run the PTX itself")
    E, H, I, k = 4, 64, 96, 2
    g = torch.Generator().manual_seed(T)
    W = MoEWeights(
        torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8),
        torch.randint(120, 130, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8),
        torch.randn(E, 2 * I, generator=g), torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8),
        torch.randint(120, 130, (E, H, I // 32), generator=g, dtype=torch.uint8), torch.randn(E, H, generator=g),
    )
    x = torch.randn(T, H, generator=g)
    tw = torch.rand(T, k, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    # float32 activations: the interpreter reads bf16 wrongly; the unpacked bf16 weights are
    # exact in float32, so the result must match emulation to float32 accumulation order.
    out = moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    ref = emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
