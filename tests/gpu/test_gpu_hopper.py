"""The Hopper kernels (``mxfx.kernels.moe_sm90``, ``mxfx.kernels.moe_sm90_ws``) on an H100/H200:
which kernel and block a call takes and that each is right (per-pair blocks, 8-row mma.sync
blocks as a PDL chain, wgmma on 32-row blocks, the warp-specialized kernel), the activation
quantization done in their epilogues, the exact redo of scales over 128, and the direct
launches' keys. The cases and the check against emulation: ``moe_cases.py``."""
from __future__ import annotations

import pytest
import torch

from moe_cases import check, gen, inputs, moe, poisoned, rel_err, spy, unfused, weights
from mxfx import formats
from mxfx.activation import GPT_OSS, SILU_AND_MUL, GatedActivation, minimax_m3
from mxfx.backends import emulation
from mxfx.moe_call import ActivationQuant, MoEWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device"),
]
moe_portable = pytest.importorskip("mxfx.kernels.moe_portable")


def test_fast_launch_keys_on_alignment(monkeypatch):
    """Repeated launches reuse the compiled kernel; an input that is not 16-byte aligned gets
    a kernel specialized for it, and every result stays right."""
    from mxfx.kernels import launch, moe_sm90, sm90_tile

    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)  # grouped blocks, two GEMM launches
    E, H, I, k, T = 8, 352, 224, 2, 9  # 2.25 rows per expert: moe_sm90, x read by its paired copy
    W = weights(E, H, I, torch.bfloat16)
    x, tw, ids = inputs(T, H, E, k, torch.bfloat16, seed=7)
    shifted = torch.empty(T * H + 1, dtype=x.dtype, device="cuda")[1:].view(T, H)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0
    ref = emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    launchers = (moe_portable.GEMM, moe_sm90.GEMM_SM90, sm90_tile._DOT_ORDER)
    # Earlier tests' launches of the same kernels, and their launch plans, are not counted.
    for g in launchers:
        monkeypatch.setattr(g, "_compiled", {})
    monkeypatch.setattr(moe._FUSED, "_plans", {})
    for inp in (x, x, shifted, shifted, x):
        out = moe.fused_moe(inp, tw, ids, W, GPT_OSS, ActivationQuant())
        assert rel_err(out, ref) <= 5e-3
    keys = [key for g in launchers for key in g._compiled]
    assert len(keys) == 4  # x's paired copy for the aligned and the shifted x; the GEMMs read their own buffers
    assert {key[key.index(torch.bfloat16) + 1] for key in keys} == {True, False}  # x's alignment


@pytest.mark.parametrize(
    "T,E,H,I,k,act,sync",
    [
        (1, 8, 2880, 2880, 4, GPT_OSS, True),  # split-K GEMM2
        (12, 16, 352, 2880, 2, minimax_m3(1.702, 1.0, 7.0), True),  # halves layout
        (14, 8, 2880, 2880, 4, GPT_OSS, False),  # 32-row blocks
        (14, 4, 352, 2880, 2, minimax_m3(1.702, 1.0, 7.0), False),
        (14, 4, 224, 96, 2, SILU_AND_MUL, False),  # no limit; K = 224, 96 below one 128-step
        (28, 4, 352, 160, 1, GatedActivation("halves", 1.1, 0.3, 3.0), False),
    ],
)
def test_hopper_kernel_taken_and_right(monkeypatch, T, E, H, I, k, act, sync):
    """On Hopper, bf16 MXFP4 up to 6 rows per expert runs :mod:`mxfx.kernels.moe_sm90` with
    mma.sync on 8-row blocks (fused and unfused, and A8: x quantized by a pass of its own, on
    grouped blocks by its paired copy, in the one launch of per-pair blocks by GEMM1 as it reads
    x; the intermediate in GEMM1's epilogue); above that, weight rows not 16 bytes apart (so not the
    warp-specialized kernel of the next test) take its wgmma on 32-row blocks; weights not
    readable as words fall back to the portable kernel. All match emulation."""
    from mxfx.kernels import moe_sm90, mx, sm90_tile

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    for replayer in (moe._FUSED, moe._UNFUSED):  # each first call runs the launch code
        monkeypatch.setattr(replayer, "_plans", {})
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)  # past one token, grouped blocks
    calls, in_one = spy(monkeypatch, moe_sm90.GEMM_SM90), spy(monkeypatch, moe_sm90.PER_PAIR_SM90)
    kw = {} if sync else {"pad": 4}
    one = T == 1  # per-pair blocks: fused_moe's GEMMs in one launch
    for fn in (moe.fused_moe, unfused):
        calls.clear()
        in_one.clear()
        check(fn, T, E, H, I, k, torch.bfloat16, act, **kw)
        if one and fn is moe.fused_moe:
            assert not calls and len(in_one) == 1
        else:
            assert [(m["SYNC_MMA"], m["BLOCK_M"]) for m in calls] == [(sync, 8 if sync else 32)] * 2 and not in_one
    calls.clear()
    in_one.clear()
    qdq, copies = spy(monkeypatch, mx._QDQ), spy(monkeypatch, sm90_tile._DOT_ORDER)
    check(moe.fused_moe, T, E, H, I, k, torch.bfloat16, act, aq=ActivationQuant("mxfp8", "even"), tol=1e-2, **kw)
    # x through the quantize pass (grouped mma.sync blocks: its paired copy; the one launch: its
    # GEMM1), the intermediate in GEMM1's epilogue.
    assert ([(m["AQ"], m.get("X_QDQ", False)) for m in calls + in_one]
            == ([(1, True)] if one else [(1, False), (0, False)]))
    grouped = sync and not one
    assert (len(qdq), [(m["FMT"], m["DOT"]) for m in copies]) == ((0, [(mx.FMT_CODES["mxfp8"], False)]) if grouped
                                                                  else (0 if one else 1, []))
    calls.clear()
    in_one.clear()
    check(moe.fused_moe, T, E, H, I, k, torch.bfloat16, act, pad=5)
    assert not calls and not in_one


@pytest.mark.parametrize("rounding", ["even", "floor", "round_up"])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("T,E,pad", [(1, 8, 0), (12, 16, 0), (14, 8, 4)])  # per pair, 8-row blocks, wgmma
def test_hopper_gemm1_quantizes_the_intermediate_as_the_separate_pass(fmt, T, E, pad, rounding):
    """Under W4A8/W4A4, moe_sm90's GEMM1 quantize-dequantizes the intermediate in its epilogue
    with the call's scale rounding: the same bits as GEMM1 without it followed by
    ``mx.quantize_dequantize``."""
    from mxfx.kernels import moe_sm90, mx

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    H, I, k = 352, 2880, 4
    W = weights(E, H, I, torch.bfloat16, pad=pad)
    x, _, ids = inputs(T, H, E, k, torch.bfloat16, seed=T)
    cfg = moe.pick_config(T * k, E, H, hopper=True, warp_specialized=False)
    assert cfg.sm90 and cfg.sync_mma == (pad == 0)
    routing = moe._route(ids, W, cfg)
    inter = []
    for aq in (ActivationQuant(fmt, rounding), ActivationQuant()):
        out = torch.full((T * k, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe._gemm(x, k, W.w13, W.w13_scale, W.w13_bias, routing, out, 0, I, H, cfg, block_n=cfg.block_n1,
                  act=GPT_OSS, aq=aq)
        inter.append(out)
    # Rows of ids -1 (inputs) are never written: both stay NaN there.
    written = (ids >= 0).flatten()
    assert inter[0][~written].isnan().all() and inter[1][~written].isnan().all()
    quantized, plain = (t[written] for t in inter)
    assert not plain.isnan().any()
    assert not torch.equal(quantized, plain)
    assert torch.equal(quantized, mx.quantize_dequantize(plain, fmt, rounding))


@pytest.mark.parametrize(
    "T,E,H,I,k,act,block_m,nc",
    [
        (300, 8, 2880, 2880, 4, GPT_OSS, 160, (3, 3)),  # ~150 rows per expert: 128- and 32-wide MMAs
        (200, 4, 352, 2880, 2, minimax_m3(1.702, 1.0, 7.0), 160, (3, 3)),  # halves layout, K tail 96
        (70, 2, 224, 160, 2, SILU_AND_MUL, 160, (3, 3)),  # no limit; K = 224, 160: two steps, tails of 96 and 32
        (40, 1, 352, 160, 1, GatedActivation("halves", 1.1, 0.3, 3.0), 64, (3, 3)),  # E = 1: 40 rows in one block
        (14, 4, 352, 2880, 2, minimax_m3(1.702, 1.0, 7.0), 32, (3, 3)),  # 7 rows per expert: 16-wide MMAs
        (44, 4, 2880, 352, 2, GPT_OSS, 32, (3, 3)),  # 22 rows per expert: 32-row blocks, 16- and 32-wide MMAs
        (600, 4, 2880, 352, 1, GPT_OSS, 160, (3, 3)),  # every token on expert 0
        (144, 4, 2880, 352, 1, GPT_OSS, 64, (3, 3)),  # all on expert 0 in 64-row blocks: 64-, 64- and 16-wide MMAs
        (130, 8, 352, 2880, 2, minimax_m3(1.702, 1.0, 7.0), 64, (3, 3)),  # ~32 rows per expert: 32- and 64-wide
        (130, 8, 512, 640, 2, SILU_AND_MUL, 64, (3, 3)),  # K steps in pairs: 4 steps (two pairs), 5 (and one)
        # In 32-row blocks, outputs that fill 256-row tiles (I = 256, 384; H = 512): four consumers.
        (44, 4, 2880, 256, 2, GPT_OSS, 32, (4, 3)),
        (40, 4, 512, 384, 2, minimax_m3(1.702, 1.0, 7.0), 32, (4, 4)),
        (48, 4, 512, 352, 2, SILU_AND_MUL, 32, (3, 4)),
        # In 64-row blocks where they take fewer rounds of tiles (132 SMs): 3 against 2, 2 against 1.
        (130, 8, 512, 4096, 2, GPT_OSS, 64, (4, 3)),
        (130, 8, 4096, 512, 2, SILU_AND_MUL, 64, (3, 4)),
        (1000, 4, 160, 224, 2, SILU_AND_MUL, 160, (3, 3)),  # ~500 rows per expert: 160-row blocks and a 32-wide tail
    ],
)
def test_warp_specialized_kernel_taken_and_right(monkeypatch, T, E, H, I, k, act, block_m, nc):
    """On Hopper, bf16 MXFP4 above 6 rows per expert runs :mod:`mxfx.kernels.moe_sm90_ws`
    (32-row blocks up to 24 rows per expert, 64-row blocks up to 56, 160-row blocks past; up to
    64 rows the unpack by one multiply, in its K order) for both GEMMs of the fused
    backend, on dot-ordered inputs (quantize-dequantized on the way under A8), as does the
    unfused backend, and matches emulation with NaN-poisoned padding around every input.
    Weights not readable as words and rows not 16 bytes apart take the other kernels. ``nc``:
    each GEMM's consumer warpgroups (:func:`mxfx.kernels.moe_sm90_ws.consumers`)."""
    from mxfx.kernels import moe_sm90, moe_sm90_ws

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    for replayer in (moe._FUSED, moe._UNFUSED):
        monkeypatch.setattr(replayer, "_plans", {})
    monkeypatch.setattr(moe_sm90_ws, "num_sms", lambda device: 132)  # an H100 / H200 SXM's: ``nc``
    calls = spy(monkeypatch, moe_sm90_ws.GEMM_SM90_WS)
    check(moe.fused_moe, T, E, H, I, k, torch.bfloat16, act, one_expert=k == 1 and E == 4)
    split = block_m <= 64
    assert [(m["BLOCK_M"], m["DOT_ORDER_OUT"], m["SPLIT"], m["NC"]) for m in calls] == [
        (block_m, True, split, nc[0]), (block_m, False, split, nc[1])]
    calls.clear()
    check(moe.fused_moe, T, E, H, I, k, torch.bfloat16, act, one_expert=k == 1 and E == 4,
           aq=ActivationQuant("mxfp8", "even"), tol=1e-2)
    assert [(m["BLOCK_M"], m["DOT_ORDER_OUT"]) for m in calls] == [(block_m, False), (block_m, False)]
    calls.clear()
    check(unfused, T, E, H, I, k, torch.bfloat16, act, one_expert=k == 1 and E == 4)
    assert [(m["GATED"], m["DOT_ORDER_OUT"]) for m in calls] == [(False, False), (False, False)]
    for fn, kw in ((moe.fused_moe, {"pad": 5}), (moe.fused_moe, {"pad": 4})):
        calls.clear()
        check(fn, T, E, H, I, k, torch.bfloat16, act, **kw)
        assert not calls


@pytest.mark.parametrize("H,I", [(224, 96), (96, 224)])
def test_one_step_k_loops_are_not_warp_specialized(monkeypatch, H, I):
    """A GEMM whose K loop is one step (K <= 128) is not given to the warp-specialized kernel,
    whose binaries ptxas miscompiled there (mxfx.kernels.wgmma_guard); 30 rows per expert take
    moe_sm90's wgmma on 32-row blocks instead, right."""
    from mxfx.kernels import moe_sm90, moe_sm90_ws

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    monkeypatch.setattr(moe._FUSED, "_plans", {})
    ws = spy(monkeypatch, moe_sm90_ws.GEMM_SM90_WS)
    sm90 = spy(monkeypatch, moe_sm90.GEMM_SM90)
    check(moe.fused_moe, 60, 4, H, I, 2, torch.bfloat16, SILU_AND_MUL)
    assert not ws and [m["BLOCK_M"] for m in sm90] == [32, 32]


@pytest.mark.parametrize("T,case", [(1, "routed"), (1, "none routed"), (3, "routed"), (4, "repeated"),
                                    (4, "32 pairs"), (5, "k = E")])
@pytest.mark.parametrize("fn", [moe.fused_moe, unfused], ids=["fused", "unfused"])
def test_per_pair_blocks_sum_the_slots_in_gemm2(monkeypatch, fn, T, case):
    """On Hopper, one token, or pairs whose expected repeated experts cost little (here up to
    16 pairs of 128 small experts, or 32 of 256), take per-pair blocks: no routing kernel, and
    GEMM2's last program of each token and column tile sums the slots, with no ``_sum_slots``
    launch; an eager fused_moe runs both GEMMs in one launch (on two streams at once too), a
    CUDA graph of it two. The output
    equals, to the bit, the grouped path's (routing kernel and ``_sum_slots``, the activations
    in registers rather than the per-pair blocks' row in shared memory), with unrouted
    slots (T=3: one of token 1's, all of token 2's; or the single token's all) and an expert
    repeated across tokens; the graph replays on new ids, again and again (GEMM2, launched by
    PDL, starts while GEMM1 runs: a read of the intermediate before its wait would show here);
    the one launch's counters are left at zero."""
    from mxfx.kernels import moe_sm90, routing

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    # 32 pairs of 256 experts: past pick_config's few-pairs tiles, still per pair. k = E: every
    # expert repeated; token 1's unrouted slot once left its counter at N1 + N2 in the one launch
    # (its GEMM1 programs counted after its GEMM2 programs, which had checked for the last count).
    E, H, I, k = {"32 pairs": (256, 352, 160, 8), "k = E": (4, 2880, 352, 4)}.get(case, (128, 352, 160, 4))
    for replayer in (moe._FUSED, moe._UNFUSED):
        monkeypatch.setattr(replayer, "_plans", {})
    W = weights(E, H, I, torch.bfloat16)
    x, tw, ids = inputs(T, H, E, k, torch.bfloat16, seed=T)
    if case == "none routed":
        ids.fill_(-1)
    if case == "repeated":
        ids[3] = ids[0].flip(0)
    gemms, sums = spy(monkeypatch, moe_sm90.GEMM_SM90), spy(monkeypatch, moe_portable.SUM_SLOTS)
    in_one = spy(monkeypatch, moe_sm90.PER_PAIR_SM90)
    out = fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    if fn is moe.fused_moe:
        assert [(m["E"], m["XROW"]) for m in in_one] == [(E, 4)] and not gemms and not sums
        # Calls on two streams at once, each with its own counters.
        streams = [torch.cuda.Stream() for _ in range(2)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        outs = []
        for s in streams:
            with torch.cuda.stream(s):
                outs += [fn(x, tw, ids, W, GPT_OSS, ActivationQuant()) for _ in range(3)]
        torch.cuda.synchronize()
        assert all(torch.equal(o, out) for o in outs)
        assert all((x.get_device(), s.cuda_stream) in moe._sync for s in streams)
        assert not any(b.any() for b in moe._sync.values())
        # Without the counters (as in a CUDA graph): two launches.
        sync_buffer = moe._sync_buffer
        monkeypatch.setattr(moe, "_sync_buffer", lambda x: None)
        monkeypatch.setattr(moe._FUSED, "_plans", {})
        assert torch.equal(out, fn(x, tw, ids, W, GPT_OSS, ActivationQuant()))
        monkeypatch.setattr(moe, "_sync_buffer", sync_buffer)
        monkeypatch.setattr(moe._FUSED, "_plans", {})
    # The activation row in shared memory, the weights 4 steps ahead (T * k * I/32 <= 512), in
    # GEMM1 3 steps ahead in each of two warpgroups (a small grid: moe._halves); GEMM2 launched by
    # PDL, GEMM1 letting it start.
    assert ([(m["PER_PAIR_E"], m["COUNTERS"], m["XROW"], m["HALVES"], m["PDL"], m["launch_pdl"]) for m in gemms]
            == [(E, 1, 3, True, moe_sm90.PDL_TRIGGER.value, False),
                (E, 2, 4, False, moe_sm90.PDL_WAIT_LOADS.value, True)]
            and not sums)
    ref = emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    assert not out.isnan().any() and rel_err(out, ref) <= 5e-3
    if case == "none routed":
        assert not out.any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    ids.copy_(ids.roll(1, 0) if T > 1 else ids.flip(1))
    for _ in range(3):
        graph.replay()
    again = fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    torch.cuda.synchronize()
    assert not any(b.any() for b in moe._sync.values())
    monkeypatch.setattr(moe, "_route", lambda ids, w, cfg: routing.align(ids, w.num_experts, cfg.block_m))
    for replayer in (moe._FUSED, moe._UNFUSED):  # recorded launches would skip _route
        monkeypatch.setattr(replayer, "_plans", {})
    gemms.clear()
    grouped = fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    assert [(m["PER_PAIR_E"], m["XROW"]) for m in gemms] == [(0, 0), (0, 0)] and len(sums) == 1
    assert torch.equal(replayed, again) and torch.equal(again, grouped)


@pytest.mark.parametrize("halves,in_gemm1", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_per_pair_x_quantized_in_gemm1_or_by_a_pass_before_it(monkeypatch, fmt, halves, in_gemm1):
    """Under activation quantization, one token on per-pair blocks (the row in shared memory):
    eager, the one launch's GEMM1 programs quantize-dequantize x's row as they read it (no
    quantize pass). In two launches, as in a CUDA graph, GEMM1 (in two warpgroups, ``halves``,
    or one) either does the same (``in_gemm1``, moe._gemm1_quantizes_x; in two warpgroups each
    its half of the row), or is launched by PDL after x's quantize pass, which lets it start at
    once: it issues its first weight loads, then waits for the pass before it reads x. All equal,
    to the bit, the grouped blocks' output (x quantize-dequantized by its paired copy), and
    emulation's up to rounding. Replayed in a graph on new x, each replay equals the call on that
    x to the bit (a read of x before the pass's end would see the previous one)."""
    from mxfx.kernels import moe_sm90, mx, routing

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    E, H, I, k = 8, 2880, 2880, 4
    aq = ActivationQuant(fmt, "even")
    monkeypatch.setattr(moe._FUSED, "_plans", {})
    if not halves:
        monkeypatch.setattr(moe, "_halves", lambda programs, k_in, device: False)
    monkeypatch.setattr(moe, "_gemm1_quantizes_x", lambda programs, hidden, device: in_gemm1)
    W = weights(E, H, I, torch.bfloat16)
    x, tw, ids = inputs(1, H, E, k, torch.bfloat16, seed=0)
    gemms, in_one, passes = spy(monkeypatch, moe_sm90.GEMM_SM90), spy(monkeypatch, moe_sm90.PER_PAIR_SM90), \
        spy(monkeypatch, mx._QDQ)
    eager = moe.fused_moe(x, tw, ids, W, GPT_OSS, aq)
    assert [m["X_QDQ"] for m in in_one] == [True] and not gemms and not passes
    monkeypatch.setattr(moe, "_sync_buffer", lambda x: None)
    monkeypatch.setattr(moe._FUSED, "_plans", {})
    out = moe.fused_moe(x, tw, ids, W, GPT_OSS, aq)
    trigger, wait = moe_sm90.PDL_TRIGGER.value, moe_sm90.PDL_WAIT_LOADS.value
    gemm1 = (True, halves, in_gemm1, trigger if in_gemm1 else trigger | wait, not in_gemm1)
    assert [m["PDL"] for m in passes] == ([] if in_gemm1 else [True])
    assert [(m["AQ"] != 0, m["HALVES"], m["X_QDQ"], m["PDL"], m["launch_pdl"]) for m in gemms] == [
        gemm1, (False, False, False, wait, True)]
    assert torch.equal(out, eager)
    assert rel_err(out, emulation.moe(x, tw, ids, W, GPT_OSS, aq)) <= 1e-2
    with monkeypatch.context() as m:
        m.setattr(moe, "_route", lambda ids, w, cfg: routing.align(ids, w.num_experts, cfg.block_m))
        m.setattr(moe._FUSED, "_plans", {})
        gemms.clear()
        grouped = moe.fused_moe(x, tw, ids, W, GPT_OSS, aq)
        assert [g["PER_PAIR_E"] for g in gemms] == [0, 0]
    assert torch.equal(out, grouped)
    monkeypatch.setattr(moe._FUSED, "_plans", {})
    x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe.fused_moe(x, tw, ids, W, GPT_OSS, aq)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.fused_moe(x, tw, ids, W, GPT_OSS, aq)
    for seed in (1, 2, 3):
        x.copy_(inputs(1, H, E, k, torch.bfloat16, seed=seed)[0])
        graph.replay()
        expected = moe.fused_moe(x, tw, ids, W, GPT_OSS, aq)
        torch.cuda.synchronize()
        assert torch.equal(replayed, expected)
        assert rel_err(replayed, emulation.moe(x, tw, ids, W, GPT_OSS, aq)) <= 1e-2


@pytest.mark.parametrize("T", [8, 20])
def test_grouped_mma_sync_blocks_run_as_a_pdl_chain(monkeypatch, T):
    """On Hopper, grouped 8-row mma.sync blocks run the routing kernels (one; at T=20, 80 pairs,
    two), x's paired copy, GEMM1, GEMM2 and the k-sum as a chain of launches by PDL, each
    starting while the one before it ends. A launch that read what the one before it writes before waiting for it would
    show here: in a CUDA graph replayed on new ids, again and again, the output equals to the bit
    the per-pair blocks' (no routing kernel, the k-sum in GEMM2) on the same ids, and emulation's
    up to rounding."""
    from mxfx.kernels import moe_sm90, moe_sm90_loops, routing, sm90_tile

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    monkeypatch.setattr(moe._FUSED, "_plans", {})
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)
    E, H, I, k = 128, 352, 160, 4
    W = weights(E, H, I, torch.bfloat16)
    x, tw, ids = inputs(T, H, E, k, torch.bfloat16, seed=T)
    gemms, sums = spy(monkeypatch, moe_sm90.GEMM_SM90), spy(monkeypatch, moe_portable.SUM_SLOTS)
    counts, places = spy(monkeypatch, routing._COUNT), spy(monkeypatch, routing._PLACE)
    pairs = spy(monkeypatch, sm90_tile._DOT_ORDER)
    eager = moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    assert [(m["PER_PAIR_E"], m["SYNC_MMA"], m["PDL"], m["launch_pdl"]) for m in gemms] == [
        (0, True, moe_sm90.PDL_WAIT_FIRST.value | moe_sm90.PDL_TRIGGER.value, True),
        (0, True, moe_sm90.PDL_WAIT_LOADS.value | moe_sm90.PDL_TRIGGER.value, True)]
    # Both GEMMs read paired activations: x's copy, launched by PDL after the routing, and the
    # intermediate as GEMM1 stores it.
    assert [(m["SPLIT"], m["DOT"], m["PDL"], m["launch_pdl"]) for m in pairs] == [(True, False, True, True)]
    assert [(m["X_ORDER"], m["PAIRED_OUT"]) for m in gemms] == [
        (moe_sm90_loops.ORDER_PAIRED.value, True), (moe_sm90_loops.ORDER_PAIRED.value, False)]
    assert [(m["PDL"], m["launch_pdl"]) for m in sums] == [(True, True)]
    assert [(m["PDL"], m.get("launch_pdl", False)) for m in places] == [(True, T == 20)]
    assert [m["PDL"] for m in counts] == [True] * (T == 20)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    outs, id_sets = [], []
    for shift in (1, 2, 3):
        ids.copy_(ids.roll(shift, 0))
        id_sets.append(ids.clone())
        graph.replay()
        outs.append(out.clone())
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", float("inf"))
    monkeypatch.setattr(moe._FUSED, "_plans", {})
    gemms.clear()
    for replayed, new_ids in zip(outs, id_sets):
        per_pair = moe.fused_moe(x, tw, new_ids, W, GPT_OSS, ActivationQuant())
        assert torch.equal(replayed, per_pair)
        assert rel_err(replayed, emulation.moe(x, tw, new_ids, W, GPT_OSS, ActivationQuant())) <= 5e-3
    assert not gemms  # per pair: both GEMMs in one launch


def test_grouped_blocks_split_a_long_gemm2_k_range(monkeypatch):
    """A few pairs with a long GEMM2 K range (I ≥ 2560, as Mixtral-8x7B's 14336) and a grid of
    more than 192 programs: grouped 8-row mma.sync blocks with GEMM2's K range in four, whose
    partials the k-sum adds; fused and unfused, A16 and A8, all match emulation."""
    from mxfx.kernels import moe_sm90

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    for replayer in (moe._FUSED, moe._UNFUSED):
        monkeypatch.setattr(replayer, "_plans", {})
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)
    T, E, H, I, k = 3, 8, 4096, 8192, 2  # 6 pairs: 4.4 experts expected × 64 column tiles
    gemms, sums = spy(monkeypatch, moe_sm90.GEMM_SM90), spy(monkeypatch, moe_portable.SUM_SLOTS)
    for fn, aq, tol in ((moe.fused_moe, ActivationQuant(), 5e-3), (unfused, ActivationQuant(), 5e-3),
                        (moe.fused_moe, ActivationQuant("mxfp8", "even"), 1e-2)):
        gemms.clear()
        sums.clear()
        check(fn, T, E, H, I, k, torch.bfloat16, SILU_AND_MUL, aq=aq, tol=tol)
        assert [(m["PER_PAIR_E"], m["SYNC_MMA"], m["SPLIT_K"]) for m in gemms] == [(0, True, 1), (0, True, 4)]
        assert [m["SPLIT_K"] for m in sums] == [4]


@pytest.mark.parametrize("path", ["per pair, one launch", "per pair, graph", "8-row blocks", "ws 32-row blocks",
                                  "ws 64-row blocks", "ws 160-row blocks"])
def test_scales_over_128_are_exact(monkeypatch, path):
    """The mma.sync loops, and the warp-specialized kernel's blocks of up to 64 rows, unpack by
    one multiply that is exact only for scales up to 128 (``sm90_tile.UNPACK_SPLIT_SMALL``); a
    program (a consumer's tile) whose weights have a larger scale computes its rows again by
    the exact unpack (in the warp-specialized kernel after its GEMM, ``moe_sm90_ws._redo``,
    from the dot-ordered activations). Expert 0's GEMM1 weights have large blocks in every row,
    in both halves of K (every GEMM1 tile of it redoes, per pair in both warpgroups of
    ``moe_sm90._half``), expert 1's GEMM2 weights in 4 rows (one tile redoes): every
    token's output matches emulation, the tokens routed there and the others. 160-row blocks
    unpack exactly in the first place."""
    from mxfx.kernels import moe_sm90, moe_sm90_ws

    if not moe_sm90.runs_on(torch.device("cuda")):
        pytest.skip("needs a Hopper GPU")
    for replayer in (moe._FUSED, moe._UNFUSED):
        monkeypatch.setattr(replayer, "_plans", {})
    E, H, I, k = 8, 512, 384, 4
    block_m = {"ws 32-row blocks": 32, "ws 64-row blocks": 64, "ws 160-row blocks": 160}.get(path)
    T = {"8-row blocks": 8, "ws 32-row blocks": 40, "ws 64-row blocks": 96, "ws 160-row blocks": 400}.get(path, 1)
    if path == "8-row blocks":
        monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)
    g = gen(3)
    w13 = torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5
    w2 = torch.randn(E, H, I, generator=g, device="cuda") / I**0.5
    w13[0, :, 64:128] *= 2.0**14
    w13[0, :, 320:352] *= 2.0**14
    w2[1, 68:72, :] *= 2.0**14
    p13, s13 = formats.quantize(w13, "mxfp4", "round_up")
    p2, s2 = formats.quantize(w2, "mxfp4", "round_up")
    assert s13[0].max() > 128 and s2[1].max() > 128 and s13[1:].max() <= 128 and s2[0].max() <= 128
    W = MoEWeights(*(poisoned(t) for t in (p13, s13, torch.zeros(E, 2 * I, dtype=torch.bfloat16, device="cuda"),
                                            p2, s2, torch.zeros(E, H, dtype=torch.bfloat16, device="cuda"))))
    x, tw, ids = inputs(T, H, E, k, torch.bfloat16, seed=5)
    ids[0] = torch.tensor([0, 1, 2, 3], dtype=ids.dtype)
    gemms, in_one = spy(monkeypatch, moe_sm90.GEMM_SM90), spy(monkeypatch, moe_sm90.PER_PAIR_SM90)
    ws = spy(monkeypatch, moe_sm90_ws.GEMM_SM90_WS)
    if path == "per pair, graph":
        monkeypatch.setattr(moe, "_sync_buffer", lambda x: None)  # as under capture: two launches
    out = moe.fused_moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    ref = emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    launched = [(m["SYNC_MMA"], m["PER_PAIR_E"], m["HALVES"]) for m in gemms]
    assert launched == {"per pair, one launch": [], "per pair, graph": [(True, E, True), (True, E, False)],
                        "8-row blocks": [(True, 0, False)] * 2}.get(path, []) and len(in_one) == (path == "per pair, one launch")
    assert [(m["BLOCK_M"], m["SPLIT"]) for m in ws] == ([(block_m, block_m <= 64)] * 2 if block_m else [])
    assert not out.isnan().any() and out[0].abs().max() > 1e3
    errors = [rel_err(out[t], ref[t]) for t in range(T) if ref[t].any()]
    assert max(errors) <= 5e-3, errors
