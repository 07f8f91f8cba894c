"""The MoE's launch code on the CPU: the fast launcher (``mxfx.kernels.launch``: keys, arguments
as Triton passes them, alignment) and which kernels, block shapes, orders and quantization a
call launches on each platform (``Launcher._launch`` recorded, no kernel run), with the
warp-specialized kernel's consumer and block-count arithmetic. The kernels themselves are
checked against the references in ``test_kernels_interpret.py``.
"""
from __future__ import annotations

import pytest
import torch

from mxfx.activation import GPT_OSS
from mxfx.moe_call import ActivationQuant

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from mxfx.kernels import mx, routing  # noqa: E402
from mxfx.kernels.moe import fused_moe, unfused_moe  # noqa: E402
from test_kernels_interpret import _routing_case, _weights  # noqa: E402


def _kernel_with_constexpr_first(x_ptr, N: tl.constexpr, y):
    pass


def test_launcher_key_separates_what_triton_specializes_on():
    from triton.runtime import JITFunction

    from mxfx.kernels.launch import Launcher, key_and_call

    with pytest.raises(ValueError, match="constexpr parameters must come last"):
        Launcher(JITFunction(_kernel_with_constexpr_first))

    def key(*args, **meta):
        return key_and_call(0, args, meta)[0]

    assert len({key(1), key(16), key(17), key(2**31), key(2**40 + 1)}) == 5
    assert key(True) != key(False) and key(True) != key(1)
    buf = torch.zeros(64, dtype=torch.float16)
    assert key(buf) != key(buf[1:]) and key(buf) != key(buf.float()) and key(buf) == key(buf[8:])
    assert key(0.5) == key(2.0) != key(None)
    assert key(buf, 1, BLOCK=16) != key(buf, 1, BLOCK=32) and key(1) != key_and_call(1, (1,), {})[0]
    _, call = key_and_call(0, (buf, 3, 0.5, True), {"BLOCK": 16})
    assert call == [buf.data_ptr(), 3, 0.5, True]


def test_launcher_passes_the_arguments_as_triton_does():
    """The direct launch hands the compiled kernel the list Triton's binder makes."""
    import inspect

    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime import JITFunction
    from triton.runtime.jit import create_function_from_signature

    from mxfx.kernels import moe_portable, moe_sm90
    from mxfx.kernels.launch import Launcher

    for kernel in (moe_portable._moe_gemm, moe_portable._sum_slots, routing._place_kernel, routing._count_kernel,
                   moe_sm90._moe_gemm_sm90, moe_sm90._moe_per_pair_sm90):
        jit = JITFunction(kernel.fn)
        launcher = Launcher(jit)
        binder = create_function_from_signature(jit.signature, jit.params, CUDABackend)
        params = list(inspect.signature(kernel.fn).parameters)
        constexprs = [p for p in params if p in launcher._constexprs]
        args = tuple(range(100, 100 + len(params) - len(constexprs)))
        meta = {name: 1000 + i for i, name in enumerate(reversed(constexprs))}
        meta.update(num_warps=4, num_stages=1)
        bound, _, _ = binder(*args, **meta)
        assert list(bound.values()) == [*args, *launcher.constexpr_values(meta)]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_launch_code_feeds_mx_activations_to_the_scaled_mma_where_native(monkeypatch, fmt):
    """On GPUs with MX matrix instructions, A8/A4 with MXFP4 weights quantize each GEMM's
    input into MX elements and scales for tl.dot_scaled; elsewhere, and for float weights,
    they are quantize-dequantized in bf16 (launches recorded)."""
    from mxfx.kernels import launch

    launched = []
    monkeypatch.setattr(launch.Launcher, "_launch",
                        lambda self, grid, a, meta: launched.append((self._kernel.__name__, meta, a)))
    E, H, I, k, T = 4, 64, 96, 2, 5
    ids, tw = _routing_case(T, E, k, 1)

    def run(native, quantized=True):
        monkeypatch.setattr(mx, "native_scaled_mma", lambda device: native)
        W = _weights(E, H, I, torch.bfloat16, quantized, True, 0, "cpu")
        launched.clear()
        fused_moe(torch.zeros(T, H, dtype=torch.bfloat16), tw.bfloat16(), ids, W, GPT_OSS, ActivationQuant(fmt))
        return [(name, meta.get("A_FMT"), meta.get("AQ")) for name, meta, _ in launched if name != "_place_kernel"]

    code = mx.FMT_CODES[fmt]
    assert run(True) == [("_quantize_kernel", None, None), ("_moe_gemm", code, 0), ("_quantize_kernel", None, None),
                         ("_moe_gemm", code, 0), ("_sum_slots", None, None)]
    gemm1 = next(a for name, _, a in launched if name == "_moe_gemm")
    assert gemm1[0].dtype == torch.uint8 and gemm1[0].shape[1] == (H // 2 if fmt == "mxfp4" else H)
    assert run(False) == [("_qdq_kernel", None, None), ("_moe_gemm", 0, code), ("_moe_gemm", 0, 0),
                          ("_sum_slots", None, None)]
    assert run(True, quantized=False) == run(False, quantized=False)


def test_launch_code_picks_the_hopper_kernel_only_where_it_fits(monkeypatch):
    """The launch code sends bf16 MXFP4 GEMMs with word-readable weights on sm_90 to the Hopper
    kernel at small T and, with 16-byte aligned weight rows, to the warp-specialized one at
    large T (x dot-ordered first, quantize-dequantized on the way under activation
    quantization); everything else to the portable kernel (launches recorded)."""
    import dataclasses

    from mxfx.kernels import launch, moe, moe_sm90, moe_sm90_ws
    from mxfx.kernels.activation import gated_activation

    launched = []
    monkeypatch.setattr(launch.Launcher, "_launch", lambda self, grid, a, meta: launched.append((self._kernel.__name__, meta)))
    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)  # T=3 on grouped 8-row blocks, not per pair
    E, H, I, k = 4, 160, 224, 2  # K loops of two steps (one-step ones are not warp-specialized)

    def kernels(T, dtype=torch.bfloat16, quantized=True, w13=None, aq=ActivationQuant()):
        W = _weights(E, H, I, dtype, quantized, True, 0, "cpu")
        W = dataclasses.replace(W, **{f.name: getattr(W, f.name).contiguous() for f in dataclasses.fields(W)
                                       if getattr(W, f.name) is not None})
        if w13 is not None:
            W = dataclasses.replace(W, w13=w13(W.w13))
        ids, tw = _routing_case(T, E, k, 1)
        launched.clear()
        fused_moe(torch.zeros(T, H, dtype=dtype), tw.to(dtype), ids, W, GPT_OSS, aq)
        return [name for name, _ in launched if "gemm" in name]

    def gemm_meta(*keys):
        return [tuple(meta.get(key) for key in keys) for name, meta in launched if "gemm" in name]

    assert kernels(3) == ["_moe_gemm_sm90"] * 2
    assert gemm_meta("SYNC_MMA", "BLOCK_M") == [(True, 8)] * 2  # mma.sync
    # Above 6 rows per expert: the warp-specialized kernel, or where the weight rows are not 16
    # bytes apart (but 4: words), wgmma on 32-row blocks.
    assert kernels(14) == ["_moe_gemm_sm90_ws"] * 2
    # Up to 24 rows per expert 32-row blocks, 10 ring slots for GEMM1, 9 for GEMM2; the unpack by
    # one multiply there and in 64-row blocks (SPLIT), not in 160-row ones.
    assert gemm_meta("BLOCK_M", "STAGES", "SPLIT") == [(32, 10, True), (32, 9, True)]
    shifted = lambda w: torch.zeros(w.shape[0], w.shape[1], w.shape[2] + 4, dtype=w.dtype)[..., :-4].copy_(w)  # noqa: E731
    assert kernels(14, w13=shifted) == ["_moe_gemm_sm90"] * 2
    assert gemm_meta("SYNC_MMA", "BLOCK_M") == [(False, 32)] * 2
    assert kernels(200) == ["_moe_gemm_sm90_ws"] * 2  # large T: warp-specialized, on dot-ordered x
    names = [name for name, _ in launched]
    assert names.index("_dot_order_kernel") < names.index("_moe_gemm_sm90_ws")
    assert gemm_meta("BLOCK_M", "DOT_ORDER_OUT", "SPLIT") == [(160, True, False), (160, False, False)]
    # Three consumers (192-row tiles) and the producer; ring slots as shared memory allows:
    # GEMM1's narrower epilogue leaves room for 4, GEMM2 3.
    assert gemm_meta("NC", "maxnreg", "CONSUMER_REGS", "PRODUCER_REGS", "STAGES") == [(3, 128, 160, 40, 4),
                                                                                      (3, 128, 160, 40, 3)]
    # 40 rows per expert: 64-row blocks, the same warpgroups, 6 ring slots.
    assert kernels(80) == ["_moe_gemm_sm90_ws"] * 2
    assert gemm_meta("BLOCK_M", "NC", "maxnreg", "CONSUMER_REGS", "PRODUCER_REGS", "STAGES", "SPLIT") == [
        (64, 3, 128, 160, 40, 6, True)] * 2
    # Activation quantization: x and the intermediate quantize-dequantized into dot order,
    # around GEMM1, which then stores the intermediate in natural order.
    assert kernels(200, aq=ActivationQuant("mxfp4", "round_up")) == ["_moe_gemm_sm90_ws"] * 2
    assert gemm_meta("DOT_ORDER_OUT") == [(False,), (False,)]
    assert [(name, meta.get("FMT"), meta.get("ROUNDING")) for name, meta in launched if name != "_count_kernel"
            and name != "_place_kernel"] == [("_dot_order_kernel", mx.FMT_MXFP4, 1), ("_moe_gemm_sm90_ws", None, None),
                                             ("_dot_order_kernel", mx.FMT_MXFP4, 1), ("_moe_gemm_sm90_ws", None, None),
                                             ("_sum_slots", None, None)]
    # The unfused backend too: GEMM1 stores [T*k, 2I] in natural order for the activation
    # kernel, whose output is dot-ordered for GEMM2.
    W = _weights(E, H, I, torch.bfloat16, True, True, 0, "cpu")
    W = dataclasses.replace(W, **{f.name: getattr(W, f.name).contiguous() for f in dataclasses.fields(W)})
    ids, tw = _routing_case(200, E, k, 1)
    launched.clear()
    unfused_moe(torch.zeros(200, H, dtype=torch.bfloat16), tw.to(torch.bfloat16), ids, W, GPT_OSS, gated_activation)
    assert [name for name, _ in launched if name not in ("_count_kernel", "_place_kernel")] == [
        "_dot_order_kernel", "_moe_gemm_sm90_ws", "_gated_activation_kernel", "_dot_order_kernel",
        "_moe_gemm_sm90_ws", "_sum_slots"]
    assert gemm_meta("GATED", "DOT_ORDER_OUT") == [(False, False), (False, False)]
    # Rows 4 but not 16 bytes apart: words, but no 16-byte copies.
    assert kernels(200, w13=shifted) == ["_moe_gemm"] * 2
    assert kernels(40, w13=shifted) == ["_moe_gemm_sm90"] * 2
    # Dot-ordered inputs of 2^31 elements or more (the producer's offsets are int32): not
    # warp-specialized.
    assert moe_sm90_ws.fits(W, 2**23 - 1, 200, 136) and not moe_sm90_ws.fits(W, 2**23, 200, 136)
    # K loops of one step (K <= 128), GEMM1's or GEMM2's: not warp-specialized (wgmma_guard).
    assert not moe_sm90_ws.fits(W, 100, 128, 136) and not moe_sm90_ws.fits(W, 100, 200, 128)
    assert kernels(3, torch.float16) == ["_moe_gemm"] * 2  # the unpack makes bf16
    assert kernels(3, quantized=False) == ["_moe_gemm"] * 2
    # Rows of the packed weights not a multiple of 4 bytes apart: not readable as words, and
    # both GEMMs of the call then take the portable kernel (with its 16-row blocks).
    padded = lambda w: torch.zeros(w.shape[0], w.shape[1], w.shape[2] + 1, dtype=w.dtype)[..., :-1].copy_(w)  # noqa: E731
    assert kernels(3, w13=padded) == ["_moe_gemm"] * 2
    assert gemm_meta("BLOCK_M") == [(16,)] * 2
    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: False)
    assert kernels(3) == ["_moe_gemm"] * 2


@pytest.mark.parametrize("rounding", ["floor", "round_up"])
def test_hopper_launches_quantize_with_the_calls_scale_rounding(monkeypatch, rounding):
    """Under W4A8, every Hopper launch that quantizes (x in the per-pair GEMM1, in the quantize
    pass or in its paired / dot-ordered copy, the intermediate in GEMM1's epilogue) is given the
    call's scale rounding, not a default (launches recorded; per pair, grouped 8-row blocks,
    wgmma blocks, warp-specialized)."""
    import dataclasses

    from mxfx.kernels import launch, moe, moe_sm90

    launched = []
    monkeypatch.setattr(launch.Launcher, "_launch",
                        lambda self, grid, a, meta: launched.append((self._kernel.__name__, meta)))
    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    E, H, I, k = 4, 160, 224, 2
    code, aq = mx.ROUNDING_CODES[rounding], ActivationQuant("mxfp8", rounding)
    W = _weights(E, H, I, torch.bfloat16, True, True, 0, "cpu")
    W = dataclasses.replace(W, **{f.name: getattr(W, f.name).contiguous() for f in dataclasses.fields(W)})
    shifted = torch.zeros(E, 2 * I, H // 2 + 4, dtype=torch.uint8)[..., :-4].copy_(W.w13)  # words, not ws

    def quantizing(T, w=W, per_pair=True):
        if not per_pair:
            monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)
        ids, tw = _routing_case(T, E, k, 1)
        launched.clear()
        fused_moe(torch.zeros(T, H, dtype=torch.bfloat16), tw.bfloat16(), ids, w, GPT_OSS, aq)
        return [(name, meta.get("AQ_ROUNDING", meta.get("ROUNDING"))) for name, meta in launched
                if meta.get("AQ") or meta.get("X_QDQ") or meta.get("FMT")]

    assert quantizing(1) == [("_moe_per_pair_sm90", code)]
    assert quantizing(3, per_pair=False) == [("_dot_order_kernel", code), ("_moe_gemm_sm90", code)]
    assert quantizing(14, dataclasses.replace(W, w13=shifted)) == [("_qdq_kernel", code), ("_moe_gemm_sm90", code)]
    assert quantizing(200) == [("_dot_order_kernel", code), ("_dot_order_kernel", code)]


def test_grouped_mma_sync_blocks_read_their_activations_paired(monkeypatch):
    """On grouped 8-row mma.sync blocks (Hopper) x is copied in the paired order after the
    routing kernels, by PDL, and quantize-dequantized on the way under activation quantization
    (no pass of its own); GEMM1 reads it so and stores the intermediate so for GEMM2. Per-pair
    blocks, the unfused backend and the warp-specialized kernel keep their own orders
    (launches recorded)."""
    import dataclasses

    from mxfx.kernels import launch, moe, moe_sm90, moe_sm90_loops
    from mxfx.kernels.activation import gated_activation

    launched = []
    monkeypatch.setattr(launch.Launcher, "_launch", lambda self, grid, a, meta: launched.append((self._kernel.__name__, meta)))
    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    E, H, I, k = 4, 160, 224, 2
    W = _weights(E, H, I, torch.bfloat16, True, True, 0, "cpu")
    W = dataclasses.replace(W, **{f.name: getattr(W, f.name).contiguous() for f in dataclasses.fields(W)})

    def run(T, aq=ActivationQuant(), fn=fused_moe):
        ids, tw = _routing_case(T, E, k, 1)
        launched.clear()
        x = torch.zeros(T, H, dtype=torch.bfloat16)
        if fn is fused_moe:
            fused_moe(x, tw.to(torch.bfloat16), ids, W, GPT_OSS, aq)
        else:
            unfused_moe(x, tw.to(torch.bfloat16), ids, W, GPT_OSS, gated_activation)
        return [(name, meta.get("X_ORDER"), meta.get("PAIRED_OUT"), meta.get("FMT"), meta.get("PDL"))
                for name, meta in launched if name not in ("_count_kernel", "_place_kernel")]

    paired, natural = moe_sm90_loops.ORDER_PAIRED.value, moe_sm90_loops.ORDER_NATURAL.value
    chain1 = moe_sm90.PDL_WAIT_FIRST.value | moe_sm90.PDL_TRIGGER.value
    chain2 = moe_sm90.PDL_WAIT_LOADS.value | moe_sm90.PDL_TRIGGER.value
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)  # T=3 on grouped 8-row blocks, not per pair

    def copies():  # x's copies: (split, dot) orders
        return [(m["SPLIT"], m["DOT"]) for name, m in launched if name == "_dot_order_kernel"]

    assert run(3) == [("_dot_order_kernel", None, None, 0, True), ("_moe_gemm_sm90", paired, True, None, chain1),
                      ("_moe_gemm_sm90", paired, False, None, chain2), ("_sum_slots", None, None, None, True)]
    assert copies() == [(True, False)]  # the paired order
    assert [meta.get("launch_pdl") for name, meta in launched if name == "_dot_order_kernel"] == [True]
    assert run(3, ActivationQuant("mxfp4", "round_up"))[:2] == [
        ("_dot_order_kernel", None, None, mx.FMT_MXFP4, True), ("_moe_gemm_sm90", paired, True, None, chain1)]
    assert [m["ROUNDING"] for name, m in launched if name == "_dot_order_kernel"] == [mx.ROUNDING_CODES["round_up"]]
    assert [name for name, _, _, _, _ in run(3, fn=unfused_moe) if "gemm" in name or "order" in name] == [
        "_moe_gemm_sm90", "_moe_gemm_sm90"]
    assert {(o, p) for name, o, p, _, _ in run(3, fn=unfused_moe) if "gemm" in name} == {(natural, False)}
    assert "_dot_order_kernel" in [name for name, *_ in run(200)] and copies() == [(False, True)]  # ws: dot order
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", float("inf"))  # per pair: the row paired in shared memory
    assert "_dot_order_kernel" not in [name for name, *_ in run(3)]


@pytest.mark.parametrize("block_m,n_out,gated,blocks,want", [
    (32, 768, True, 128, 4), (32, 2048, False, 128, 4),  # Qwen3-30B-A3B: 256-row tiles fit
    (32, 14336, True, 8, 4), (32, 4096, False, 8, 4),  # Mixtral-8x7B
    (32, 2880, True, 128, 3), (32, 2880, False, 128, 3),  # gpt-oss: 192-row tiles fit, 256-row ones do not
    (32, 352, True, 4, 3), (32, 512, False, 4, 4),  # a tensor-parallel shard
    # 64-row blocks, 132 SMs: rounds of tiles of 192 / 256 rows.
    (64, 14336, True, 8, 4),  # Mixtral-8x7B GEMM1: 10 / 7
    (64, 4096, False, 8, 4),  # GEMM2: 2 / 1
    (64, 4096, False, 9, 3),  # 2 / 2
    (64, 4096, False, ((8, 0.8), (9, 0.2)), 4),  # 2 / 1.2
    (64, 4096, False, "Mixtral-8x7B T=208", 4),  # 52 rows per expert: 9 blocks one time in five
    (64, 4096, False, "Mixtral-8x7B T=224", 3),  # 56 rows: 9 or more blocks three times in five
    (64, 768, True, 128, 3),  # Qwen3-30B-A3B GEMM1: 8 / 6
    (64, 2048, False, 128, 3),  # GEMM2: 11 / 8 (32 x 1.05 > 33)
    (64, 2048, False, "Qwen3-30B-A3B T=896", 3),  # 12.5 / 9.1 (where the mean, 144.3 blocks, gives 13 / 9)
    (64, 6144, False, 128, 3),  # MiniMax-M3 GEMM2: 63 / 47
    (64, 512, False, 8, 3),  # one round either way
    (160, 4096, False, 8, 3),  # 160-row blocks: three (their accumulators take the registers)
])
def test_warp_specialized_consumers_by_tile_fit(block_m, n_out, gated, blocks, want):
    """Four consumer warpgroups (256-row tiles) only where a GEMM's outputs fill whole tiles of
    them: in 32-row blocks always, in 64-row ones where they take enough fewer rounds of tiles,
    in expectation over the routings (tools/PERF_LOG.md, sessions 32-34). ``blocks``: a count,
    (blocks, probability) pairs, or a model and T whose random routings give them."""
    from mxfx.kernels import moe_sm90_ws, routing
    from mxfx.oracle.shapes import SHAPES
    if isinstance(blocks, int):
        blocks = ((blocks, 1.0),)
    elif isinstance(blocks, str):
        model, T = blocks.split(" T=")
        shape = SHAPES[model]
        blocks = routing.blocks_pmf(int(T) * shape.top_k, shape.num_experts, block_m)
    assert moe_sm90_ws.consumers(block_m, n_out, gated, blocks, 132) == want


@pytest.mark.parametrize("pairs,experts,block_m", [(256, 8, 64), (448, 8, 64), (416, 8, 64), (4096, 128, 64),
                                                  (3584, 128, 64), (1024, 128, 32), (40, 8, 32), (100, 1, 64),
                                                  (1, 128, 32)])
def test_blocks_pmf_matches_random_routings(pairs, experts, block_m):
    """routing.blocks_pmf against the blocks that 2000 uniformly random routings take: its mean
    within 1 %, its distribution within 0.15 in total variation (the experts taken as independent
    spread it a little: 0.11 at 448 pairs over 8 experts)."""
    from mxfx.kernels import routing
    g = torch.Generator().manual_seed(0)
    n = 2000
    counts = torch.stack([torch.bincount(torch.randint(0, experts, (pairs,), generator=g), minlength=experts)
                          for _ in range(n)])
    taken = ((counts + block_m - 1) // block_m).sum(1)
    pmf = routing.blocks_pmf(pairs, experts, block_m)
    assert [b for b, _ in pmf] == sorted(b for b, _ in pmf) and abs(sum(p for _, p in pmf) - 1) < 1e-6
    mean = sum(b * p for b, p in pmf)
    assert abs(mean - taken.double().mean().item()) <= 0.01 * mean
    seen = torch.bincount(taken).double() / n
    model = dict(pmf)
    tv = 0.5 * sum(abs(seen[b].item() - model.get(b, 0.0)) for b in range(len(seen)))
    tv += 0.5 * sum(p for b, p in pmf if b >= len(seen))
    assert tv <= 0.15, (tv, pmf, seen.nonzero().flatten().tolist())
    assert -(-pairs // block_m) <= pmf[0][0] and pmf[-1][0] <= routing.max_blocks(pairs, experts, block_m)
    assert routing.blocks_pmf(0, experts, block_m) == ((0, 1.0),)


def test_launcher_key_separates_8_from_16_byte_alignment():
    """A tensor 8 bytes off a 16-byte boundary is keyed apart from an aligned one: Triton
    specializes pointers on 16-byte alignment, so they need different compiled kernels."""
    from mxfx.kernels.launch import key_and_call

    buf = torch.zeros(64, dtype=torch.float16)
    assert buf.data_ptr() % 16 == 0
    assert key_and_call(0, (buf,), {})[0] != key_and_call(0, (buf[4:],), {})[0]


def test_next_power_of_2_matches_triton():
    """``next_power_of_2`` is the least power of two >= n (a power of two is its own), as
    Triton's, and 0 for 0: block sizes sized by it are not doubled."""
    import triton

    from mxfx.kernels.launch import next_power_of_2

    for n in [0, 1, 2, 3, 4, 5, 63, 64, 65, 1024, 1025]:
        assert next_power_of_2(n) == (triton.next_power_of_2(n) if n else 0)
