"""Launch plans (:mod:`mxfx.kernels.replay`) on CPU: the launches are recorded, not run, so
what is checked is what each replayed launch is handed against what a fresh call hands it.
On the GPU, tests/gpu checks that replayed calls compute the right result."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from mxfx.activation import GPT_OSS, SILU_AND_MUL  # noqa: E402
from mxfx.kernels import activation, launch, moe, moe_portable  # noqa: E402
from mxfx.kernels.replay import Replayer, _pack  # noqa: E402
from mxfx.moe_call import ActivationQuant, MoEWeights  # noqa: E402

E, H, I, K = 8, 64, 96, 2


class _Logged:
    """Stands for a compiled kernel: logs what it is called with."""

    log: list = []

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, grid, stream, call) -> None:
        self.log.append((self.name, grid, list(call)))


@pytest.fixture
def logged(monkeypatch) -> list:
    """Launches logged as the direct path would make them, CPU tensors taken for CUDA ones."""

    def fake_launch(self, grid, args, meta):
        _, call = launch.key_and_call(0, args, meta)
        direct = _Logged(self._kernel.__name__)
        direct(grid, 0, call)
        if launch.recorded() is not None:
            launch.recorded().append((direct, grid, args, call))

    monkeypatch.setattr(launch.Launcher, "_launch", fake_launch)
    monkeypatch.setattr(launch, "direct_launches", lambda t: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    _Logged.log = []
    return _Logged.log


def _inputs(T: int, seed: int, quantized: bool = True, H: int = H, I: int = I, fused: bool = True,
            sync: torch.Tensor | None = None) -> tuple:
    """The tensors of ``moe._fused_moe`` (``fused``: with its counters, ``sync``) or ``_unfused_moe``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, K, generator=g)
    if quantized:
        w = (torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8),
             torch.randint(100, 130, (E, 2 * I, H // 32), dtype=torch.uint8), torch.randn(E, 2 * I),
             torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8),
             torch.randint(100, 130, (E, H, I // 32), dtype=torch.uint8), torch.randn(E, H))
    else:
        w = (torch.randn(E, 2 * I, H), None, None, torch.randn(E, H, I), None, None)
    return (x, tw, ids, *w, sync) if fused else (x, tw, ids, *w)


def _canonical(log: list, inputs: tuple, out: torch.Tensor, positions: list) -> list:
    """Each launch's arguments with the addresses at ``positions`` named: an input by index,
    the output, or the n-th distinct other address (a temporary)."""
    temps: dict[int, int] = {}
    canon = []
    for (name, grid, call), pos in zip(log, positions):
        call = list(call)
        for p in pos:
            addr = call[p]
            hits = [i for i, t in enumerate(inputs) if t is not None and t.data_ptr() == addr]
            call[p] = (("input", hits[0]) if hits else ("out",) if addr == out.data_ptr()
                       else ("temp", temps.setdefault(addr, len(temps))))
        canon.append((name, grid, call))
    return canon


def _temps_renamed(replayed: list, fresh: list) -> list:
    """``replayed`` (canonical) with each temporary renamed to the fresh call's temporary at
    the same place. A replayed address may stand for several fresh temporaries (the workspace
    reuses bytes), but only for ones no launch uses together, and each fresh temporary must
    always be handed the same replayed address."""
    names: dict = {}
    spans: dict = {}
    renamed = []
    for i, ((name, grid, call), (_, _, fresh_call)) in enumerate(zip(replayed, fresh)):
        call = list(call)
        for p, (a, f) in enumerate(zip(call, fresh_call)):
            if isinstance(a, tuple) and a[0] == "temp" and isinstance(f, tuple) and f[0] == "temp":
                assert names.setdefault(f, a) == a, (f, a)
                spans.setdefault(f, [i, i])[1] = i
                call[p] = f
        renamed.append((name, grid, call))
    for f, g in ((f, g) for f in names for g in names if f < g and names[f] == names[g]):
        assert spans[f][1] < spans[g][0] or spans[g][1] < spans[f][0], (f, g, spans)
    return renamed


def _check_workspace(plan) -> None:
    """Temporaries used by a common launch get disjoint bytes, and the workspace is the most
    that any one launch has live (each region rounded up to the 256-byte alignment)."""
    regions = plan.regions
    for a, b in ((a, b) for a in regions for b in regions if a is not b):
        if a.first <= b.last and b.first <= a.last:
            assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset, (a, b)
    live = [sum(-(-r.nbytes // 256) * 256 for r in regions if r.first <= i <= r.last)
            for i in range(len(plan.launches))]
    assert plan.workspace <= max(live, default=0)


@pytest.mark.parametrize("fused,T,quantized,aq", [
    (True, 1, True, "none"), (True, 40, True, "none"), (True, 5, False, "none"), (True, 3, True, "mxfp8"),
    (False, 1, True, "none"), (False, 40, True, "none"), (False, 5, False, "none"),  # A16 only
])
def test_replay_hands_each_kernel_what_a_fresh_call_does(logged, fused, T, quantized, aq):
    fn = moe._fused_moe if fused else moe._unfused_moe
    rep = Replayer(fn)
    static = (GPT_OSS, ActivationQuant(aq)) if fused else (GPT_OSS, activation.gated_activation)
    rep(_inputs(T, 0, quantized, fused=fused), static)  # records
    (plan,) = rep._plans.values()
    assert not isinstance(plan, str), plan
    assert len(plan.launches) == len(logged) >= 3
    if not fused:
        assert "_gated_activation_kernel" in [name for name, _, _ in logged]

    second = _inputs(T, 1, quantized, fused=fused)
    logged.clear()
    out = rep(second, static)  # replays
    replayed = list(logged)
    logged.clear()
    fresh_out = fn(*second, *static)
    positions = [[p for p, _, _ in step.patches] for step in plan.launches]
    assert out.shape == fresh_out.shape and out.dtype == fresh_out.dtype
    fresh = _canonical(logged, second, fresh_out, positions)
    assert _temps_renamed(_canonical(replayed, second, out, positions), fresh) == fresh
    # every address the replay hands over is an input, the output or inside its workspace
    assert all(pos for pos in positions)
    _check_workspace(plan)


@pytest.mark.parametrize("aq", ["none", "mxfp4"])
def test_workspace_reuses_the_bytes_of_temporaries_no_longer_used(logged, monkeypatch, aq):
    """The warp-specialized path (Hopper patched in) allocates x dot-ordered, the intermediate
    (twice under activation quantization), GEMM2's float32 per-slot results and, in blocks of up
    to 64 rows, each GEMM's flags of tiles to redo; the replay's workspace holds only what is
    live at once: less than their sum, and what GEMM2 and the k-sum need (the intermediate and
    the per-slot results) is a lower bound."""
    from mxfx.kernels import moe_sm90

    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    T, h, i = 200, 160, 224  # 50 rows per expert; K loops of two steps (one-step ones are not warp-specialized)
    rep = Replayer(moe._fused_moe)
    inputs = _inputs(T, 0, H=h, I=i)
    rep(inputs, (GPT_OSS, ActivationQuant(aq)))
    (plan,) = rep._plans.values()
    assert not isinstance(plan, str), plan
    names = [step.direct.name for step in plan.launches]
    assert names.count("_moe_gemm_sm90_ws") == 2 and names.count("_dot_order_kernel") == (2 if aq != "none" else 1)
    _check_workspace(plan)
    rows = T * K
    inter, per_slot = rows * 256 * 2, rows * h * 4  # I = 224 padded to 256 columns, bf16; float32
    assert inter + per_slot <= plan.workspace < sum(r.nbytes for r in plan.regions)
    # x dot-ordered, the intermediate (natural and dot-ordered under A4), the per-slot results,
    # the routing's counts, sorted pairs and per-block expert and rows, and in these 64-row
    # blocks each GEMM's flags of tiles to redo (moe_sm90_ws._redo)
    assert len(plan.regions) == (4 if aq != "none" else 3) + 4 + 2


@pytest.mark.parametrize("T", [1, 2])
def test_a_single_token_on_hopper_needs_no_routing_kernel(logged, monkeypatch, T):
    """With mma.sync (Hopper patched in) and no persistent counters (as while a CUDA graph is
    captured), one token's pairs are each their own block: both GEMMs read the ids
    themselves (for the blocks' experts, the pairs and the blocks' rows), no routing kernel
    runs, and GEMM2 sums the slots into the output at counters that GEMM1 zeroes, with no
    ``_sum_slots`` launch. Two tokens whose expected repeats cost more than
    ``PER_PAIR_REPEAT_BYTES`` (here 0; see test_few_repeats_go_per_pair) are grouped by the
    routing kernel, and GEMM1 reads x's paired copy (``moe_sm90.paired``), not x."""
    from mxfx.kernels import moe_sm90

    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    monkeypatch.setattr(moe, "PER_PAIR_REPEAT_BYTES", 0)
    inputs = _inputs(T, 0)
    out = moe._fused_moe(*inputs, GPT_OSS, ActivationQuant())
    names = [name for name, _, _ in logged]
    ids = inputs[2].data_ptr()
    if T == 1:
        assert names == ["_moe_gemm_sm90", "_moe_gemm_sm90"]
        (_, _, gemm1), (_, _, gemm2) = logged
        assert gemm1.count(ids) == gemm2.count(ids) == 3
        # The last runtime arguments: the counters, how many, the sum's output and its row stride.
        assert gemm1[-4] == gemm2[-4] and gemm1[-3] == gemm2[-3] == 1  # T * cdiv(H, 64)
        assert gemm2[-2:] == [out.data_ptr(), H] and gemm1[-2:] != gemm2[-2:]
    else:
        assert names == ["_place_kernel", "_dot_order_kernel", "_moe_gemm_sm90", "_moe_gemm_sm90", "_sum_slots"]
        assert all(call.count(ids) == 0 for _, _, call in logged[2:4])
        x = inputs[0].data_ptr()
        assert logged[1][2][0] == x and x not in logged[2][2] and logged[1][2][1] in logged[2][2]


@pytest.mark.parametrize("words,launches", [(moe._SYNC_WORDS, ["_moe_per_pair_sm90"]),
                                             (1 + K + 1, ["_moe_per_pair_sm90"]),
                                             (K + 1, ["_moe_gemm_sm90", "_moe_gemm_sm90"])])
def test_per_pair_gemms_run_as_one_launch_given_counters(logged, monkeypatch, words, launches):
    """Given the persistent counters (moe._sync_buffer, in eager calls) and room in them for
    the ticket, one counter per pair and the k-sum's per token and column tile, both GEMMs and
    the k-sum of a per-pair call are one launch, a program per GEMM1 and GEMM2 tile, planned for
    replay with the counters as an input; without room, two launches."""
    from mxfx.kernels import moe_sm90

    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    sync = torch.zeros(words, dtype=torch.int32)
    inputs = _inputs(1, 0, sync=sync)
    rep = Replayer(moe._fused_moe)
    out = rep(inputs, (GPT_OSS, ActivationQuant()))
    assert [name for name, _, _ in logged] == launches
    if len(launches) == 1:
        (_, grid, call), = logged
        assert grid == (K * (-(-I // 32) + -(-H // 64) * 4),)  # GEMM1 tiles of 32 columns, GEMM2's of 64 split 4 ways
        assert call.count(inputs[2].data_ptr()) == 1 and call.count(sync.data_ptr()) == 1
        assert out.data_ptr() in call
        (plan,) = rep._plans.values()
        assert not isinstance(plan, str), plan
        (step,) = plan.launches
        assert (call.index(sync.data_ptr()), len(inputs) - 1, 0) in step.patches


def _model_weights(E: int, H: int, I: int) -> MoEWeights:
    """MXFP4 weights of a model's sizes, every expert a view of one (only their sizes are read)."""
    def t(*shape, dtype=torch.uint8):
        return torch.zeros(1, *shape, dtype=dtype).expand(E, *shape)

    return MoEWeights(t(2 * I, H // 2), t(2 * I, H // 32), t(2 * I, dtype=torch.bfloat16), t(H, I // 2),
                      t(H, I // 32), t(H, dtype=torch.bfloat16))


@pytest.mark.parametrize("T,E,k,H,I,per_pair", [
    (1, 8, 2, 4096, 14336, True),  # one token: its experts are distinct
    (6, 128, 4, 2880, 2880, True),  # gpt-oss-120b: 2.1 repeats expected of 13.2 MB, 27 MB
    (7, 128, 4, 2880, 2880, False),  # 2.8 repeats, 37 MB
    (4, 128, 8, 2048, 768, True),  # Qwen3-30B-A3B: 3.7 repeats of 2.5 MB
    (12, 128, 8, 2048, 768, False),  # 28 repeats, 71 MB
    (2, 8, 2, 4096, 14336, False),  # Mixtral-8x7B: 0.7 repeats of 94 MB
])
def test_few_repeats_go_per_pair(monkeypatch, T, E, k, H, I, per_pair):
    """Per-pair blocks where the GEMMs run mma.sync and there is one token or the experts that
    uniformly routed pairs are expected to repeat cost at most ``PER_PAIR_REPEAT_BYTES``;
    grouped blocks elsewhere, as the head of a chain of launches by PDL where they run mma.sync."""
    monkeypatch.setattr(moe, "align", lambda ids, E, block_m, pdl: ("grouped", pdl))
    ids = torch.zeros(T, k, dtype=torch.int32)
    w = _model_weights(E, H, I)
    for sync in (True, False):
        cfg = moe.GemmConfig(8, 32, 64, 128, 4, swap=True, split=True, sm90=True, sync_mma=sync)
        routing = moe._route(ids, w, cfg)
        assert routing == ("grouped", sync) if not (per_pair and sync) else routing.per_pair_experts == E


@pytest.mark.parametrize("P,E", [(24, 128), (64, 128), (16, 32), (4, 8)])
def test_expected_repeats_match_random_routing(P, E):
    g = torch.Generator().manual_seed(P)
    ids = torch.randint(0, E, (20000, P), generator=g)
    seen = torch.zeros(20000, E).scatter_(1, ids, 1.0).sum(1)
    assert moe.expected_repeats(P, E) == pytest.approx((P - seen).mean().item(), rel=0.03)


@pytest.mark.parametrize("pairs,E,H,I,split", [(4, 128, 2880, 2880, 4), (2, 8, 4096, 4096, 4), (8, 128, 2880, 2880, 4),
                                                (8, 32, 2880, 2880, 4), (16, 32, 2880, 2880, 1), (16, 128, 2880, 2880, 1),
                                                (8, 128, 2048, 768, 1), (4, 128, 6144, 3072, 4), (8, 128, 6144, 3072, 1),
                                                (4, 8, 4096, 4096, 4), (4, 8, 4096, 14336, 4), (10, 8, 4096, 14336, 4),
                                                (12, 8, 4096, 14336, 1), (8, 128, 2880, 2560, 4),
                                                (8, 128, 2880, 2559, 1), (10, 128, 2880, 8192, 1)])
def test_gemm2_split_on_hopper_follows_its_grid(pairs, E, H, I, split):
    """A few pairs on Hopper: GEMM2's K range in four where its grid (experts expected among
    the pairs × H/64) is at most 192 programs, or at most 400 where that K range (I) is 2560 or
    more, else whole; the portable kernel keeps its two."""
    assert moe.pick_config(pairs, E, H, hopper=True, intermediate=I).split_k2 == split
    assert moe.pick_config(pairs, E, H, intermediate=I).split_k2 == 2


@pytest.mark.parametrize("programs,k_in,halves", [(360, 2880, True), (792, 2880, True), (793, 2880, False),
                                                  (896, 4096, False), (12, 160, True), (12, 128, False)])
def test_per_pair_gemm1_runs_in_halves_while_its_grid_is_small(monkeypatch, programs, k_in, halves):
    """Per-pair GEMM1 runs each program's K loop in two warpgroups, half the steps each, while
    its programs (8 warps, 3 per SM) take at most two waves of 132 SMs and K has two steps
    (gpt-oss-120b T=1: 360 programs; T=2: 720; Mixtral-8x7B T=1: 896, whole)."""
    monkeypatch.setattr(moe, "num_sms", lambda device: 132)
    assert moe._halves(programs, k_in, torch.device("cpu")) == halves


@pytest.mark.parametrize("programs,hidden,in_gemm1", [
    (192, 2048, True), (384, 2048, True), (576, 2048, False),  # Qwen3-30B-A3B T=1, 2, 3
    (360, 2880, False), (384, 6144, False),  # gpt-oss T=1, MiniMax-M3 T=1
    (281, 2880, True), (282, 2880, False)])  # about the bound
def test_per_pair_gemm1_quantizes_x_itself_while_that_is_little_work_per_sm(monkeypatch, programs, hidden, in_gemm1):
    """Under activation quantization in two launches, per-pair GEMM1 quantizes x's row itself
    (every program the whole row) while its programs quantize at most 6144 values per SM of 132,
    else GEMM1 waits for x's quantize pass."""
    monkeypatch.setattr(moe, "num_sms", lambda device: 132)
    assert moe._gemm1_quantizes_x(programs, hidden, torch.device("cpu")) == in_gemm1


@pytest.mark.parametrize("in_gemm1", [True, False])
def test_per_pair_gemm1_reads_x_itself_or_the_quantize_pass_output(logged, monkeypatch, in_gemm1):
    """One token on Hopper (patched in) under W4A8, in two launches (no persistent counters, as
    while a CUDA graph is captured): where GEMM1 quantizes x itself it reads x and no quantize
    pass runs; else the pass runs first and GEMM1 reads what it wrote."""
    from mxfx.kernels import moe_sm90

    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    monkeypatch.setattr(moe, "_gemm1_quantizes_x", lambda programs, hidden, device: in_gemm1)
    inputs = _inputs(1, 0)
    moe._fused_moe(*inputs, GPT_OSS, ActivationQuant("mxfp8"))
    names = [name for name, _, _ in logged]
    x = inputs[0].data_ptr()
    if in_gemm1:
        assert names == ["_moe_gemm_sm90", "_moe_gemm_sm90"] and x in logged[0][2]
    else:
        assert names == ["_qdq_kernel", "_moe_gemm_sm90", "_moe_gemm_sm90"]
        assert logged[0][2][0] == x and x not in logged[1][2] and logged[0][2][1] in logged[1][2]


@pytest.mark.parametrize("pairs,H,I,stages", [(4, 2880, 2880, 4), (8, 2880, 2880, 3), (16, 2048, 768, 4),
                                                (12, 2048, 2880, 3), (2, 4096, 14336, 3), (16, 128, 32, 4),
                                                (32, 7168, 2048, 3), (32, 7168, 256, 4)])
def test_per_pair_weight_stages_follow_gemm1s_grid(pairs, H, I, stages):
    """On Hopper's mma.sync tiles (which per-pair blocks take): the per-pair K loop loads the
    weights 4 steps ahead while GEMM1's grid (pairs × I/32) is at most 512 programs, else 3;
    I, not H, sets it. 32 pairs of 256 experts: past the few-pairs tiles."""
    cfg = moe.pick_config(pairs, 256, H, hopper=True, intermediate=I)
    assert cfg.sync_mma and cfg.x_row_stages == stages
    assert moe.pick_config(pairs, 256, H).x_row_stages == 0


def test_replay_keys_on_shape_and_alignment(logged):
    rep = Replayer(moe._fused_moe)
    static = (GPT_OSS, ActivationQuant())
    inputs = _inputs(4, 0)
    rep(inputs, static)
    rep(_inputs(4, 1), static)
    assert len(rep._plans) == 1
    rep(_inputs(5, 1), static)
    shifted = torch.empty(4 * H + 1, dtype=torch.bfloat16)[1:].view(4, H)
    rep((shifted, *inputs[1:]), static)
    assert len(rep._plans) == 3


def _op_args(inputs: tuple, backend: str) -> tuple:
    """``torch.ops.mxfx.moe``'s arguments for :func:`_inputs`' tensors (without the counters)."""
    return (*inputs[:9], GPT_OSS.layout, GPT_OSS.alpha, GPT_OSS.beta, GPT_OSS.limit, "none", backend, "even")


@pytest.mark.parametrize("backend", ["triton", "triton_unfused"])
def test_op_calls_replay_on_the_ops_key(logged, monkeypatch, backend):
    """``torch.ops.mxfx.moe`` passes the Triton backends its checked signature as the replay's
    key (no second key built): a call with new tensors of the same signature replays what a fresh
    call hands the kernels, while x at another 16-byte alignment or a weight with other strides
    is a new signature, recorded anew."""
    from mxfx import ops
    from mxfx.oracle import Platform

    hopper = Platform("cuda", "sm90", frozenset({"triton"}))
    monkeypatch.setattr(ops.Platform, "current", staticmethod(lambda device=None: hopper))
    monkeypatch.setattr(ops, "_CHECKED", {})
    fused = backend == "triton"
    rep = moe._FUSED if fused else moe._UNFUSED
    monkeypatch.setattr(rep, "_plans", {})
    fn = moe._fused_moe if fused else moe._unfused_moe
    static = (GPT_OSS, ActivationQuant()) if fused else (GPT_OSS, activation.gated_activation)

    torch.ops.mxfx.moe(*_op_args(_inputs(4, 0), backend))  # records
    (key,) = rep._plans
    assert isinstance(key[1][0], ops._Resolved)
    (plan,) = rep._plans.values()
    positions = [[p for p, _, _ in step.patches] for step in plan.launches]

    def replayed_as_fresh(inputs: tuple) -> None:
        logged.clear()
        out = torch.ops.mxfx.moe(*_op_args(inputs, backend))
        replayed = list(logged)
        logged.clear()
        args = (*inputs[:9], None) if fused else inputs[:9]
        fresh_out = fn(*args, *static)
        fresh = _canonical(logged, args, fresh_out, positions)
        assert _temps_renamed(_canonical(replayed, args, out, positions), fresh) == fresh

    replayed_as_fresh(_inputs(4, 1))
    assert len(rep._plans) == 1
    second = _inputs(4, 2)
    shifted = torch.empty(4 * H + 1, dtype=torch.bfloat16)[1:].view(4, H)
    shifted.copy_(second[0])
    logged.clear()
    torch.ops.mxfx.moe(*_op_args((shifted, *second[1:]), backend))
    assert len(rep._plans) == 2
    w2_bias = second[8].t().contiguous().t()  # same shape and values, other strides
    assert w2_bias.stride() != second[8].stride()
    torch.ops.mxfx.moe(*_op_args((*second[:8], w2_bias), backend))
    assert len(rep._plans) == 3
    replayed_as_fresh((*_inputs(4, 3)[:8], w2_bias))
    assert len(rep._plans) == 3


def test_a_call_doing_more_than_launches_is_left_unplanned(logged):
    """Non-contiguous ids are copied by ``reshape``: that copy is not a launch, so the
    signature gets no plan and every call runs the launch code."""
    rep = Replayer(moe._fused_moe)
    x, tw, ids, *w, sync = _inputs(6, 0)
    ids_t = ids.t().contiguous().t()
    static = (GPT_OSS, ActivationQuant())
    rep((x, tw, ids_t, *w, sync), static)
    assert list(rep._plans.values()) == ["it ran aten.clone.default"]
    logged.clear()
    rep((x, tw, ids_t, *w, sync), static)
    assert logged and logged[0][0] == "_place_kernel"


def test_a_launch_through_triton_leaves_the_call_unplanned(logged, monkeypatch):
    def through_triton(self, grid, args, meta):
        launch.recorded().append(None)

    monkeypatch.setattr(launch.Launcher, "_launch", through_triton)
    rep = Replayer(moe._fused_moe)
    rep(_inputs(2, 0), (GPT_OSS, ActivationQuant()))
    assert list(rep._plans.values()) == ["a launch went through Triton"]


def test_a_recording_sees_only_its_own_threads_launches():
    import threading

    mine, seen = [], []
    with launch.recording(mine):
        other = threading.Thread(target=lambda: seen.append(launch.recorded()))
        other.start()
        other.join()
        assert launch.recorded() is mine
    assert seen == [None] and launch.recorded() is None


def _one_launch(a: torch.Tensor, b: torch.Tensor, view=lambda t: t, ret=None) -> torch.Tensor:
    """A host function of one launch (the k-sum kernel's launcher, logged by the fixture)."""
    out = torch.empty(a.shape, dtype=a.dtype)
    moe_portable.SUM_SLOTS[(1,)](view(a), b, out, 4, 1, 4, 4, TOPK=1, SPLIT_K=1, BLOCK_H=4)
    return out if ret is None else ret(a, out)


@pytest.mark.parametrize("case,static,reason", [
    ("interior view of an input", (lambda t: t[1:], None), "argument 0 of _sum_slots is not an input"),
    ("returns an input", (lambda t: t, lambda a, out: a), "its output is not a tensor it allocated"),
    ("returns a view", (lambda t: t, lambda a, out: out[1:]), "its output is not a tensor it allocated"),
])
def test_replay_refuses_what_it_cannot_trace(logged, case, static, reason):
    rep = Replayer(_one_launch)
    a, b = torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    rep((a, b), static)
    (plan,) = rep._plans.values()
    assert isinstance(plan, str) and plan.startswith(reason), plan


def test_replay_refuses_inputs_sharing_the_address_it_uses(logged):
    rep = Replayer(_one_launch)
    a = torch.zeros(8)
    rep((a, a.view(torch.int32)), (lambda t: t, None))
    (plan,) = rep._plans.values()
    assert plan == "argument 0 of _sum_slots is the address of several inputs"


def test_temporaries_tool_plans_an_eager_call():
    """``tools/moe_temporaries.py --plan`` (README's temporaries): gpt-oss-120b at T=8 holds the
    intermediate (k·I/H = 4x the bytes of x) and GEMM2's float32 per-slot results (8x) and the
    routing's few KB; at T=1 (per-pair blocks, one launch) GEMM2's four K-split partials of each
    slot (36x)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "moe_temporaries.py"
    spec = importlib.util.spec_from_file_location("moe_temporaries", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert 12.0 <= tool.plan_ratio("gpt-oss-120b", 8, "none") < 12.1
    assert tool.plan_ratio("gpt-oss-120b", 1, "none") == 36.0


def test_host_profile_tool_measures_the_replayed_call():
    """``tools/profile_moe_eager.py --host-only`` (no GPU) times the op as it runs on a GPU:
    replayed from a plan, launches recorded instead of run."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "profile_moe_eager.py"
    run = subprocess.run([sys.executable, str(tool), "--host-only", "--calls", "3"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split("  ")[0] for line in lines[:3]] == [
        "torch.ops.mxfx.moe", "the op's body, no dispatcher", "fused_moe"]
    assert lines[3] == "replayed from a plan: True"


def test_replay_keys_on_the_static_arguments(logged):
    """Calls with the same tensors but another activation or activation quantization are not
    replayed from each other's plan: each gets its own, and hands GEMM1 its own constants."""
    rep = Replayer(moe._fused_moe)
    inputs = _inputs(4, 0)
    rep(inputs, (GPT_OSS, ActivationQuant()))
    rep(inputs, (SILU_AND_MUL, ActivationQuant()))
    rep(inputs, (GPT_OSS, ActivationQuant("mxfp8")))
    assert len(rep._plans) == 3
    logged.clear()
    rep(inputs, (SILU_AND_MUL, ActivationQuant()))  # replayed
    replayed = list(logged)
    logged.clear()
    moe._fused_moe(*inputs, SILU_AND_MUL, ActivationQuant())
    fresh = list(logged)

    def gemm1_floats(launches):
        call = next(call for name, _, call in launches if "gemm" in name)
        return [a for a in call if isinstance(a, float)]

    assert gemm1_floats(replayed) == gemm1_floats(fresh) and float(SILU_AND_MUL.alpha) in gemm1_floats(replayed)


def test_workspace_regions_are_aligned_and_fill_exact_gaps():
    """Each temporary's region starts at a multiple of 256 bytes (as the caching allocator's
    blocks, which the kernels' 16-byte specialization was recorded on), and a temporary that
    exactly fills the bytes below a live region reuses them."""
    # key -> (bytes, first launch, last launch)
    regions = _pack({1: (1000, 0, 0), 2: (100, 0, 1), 3: (512, 1, 1)})
    assert all(r.offset % 256 == 0 for r in regions.values())
    assert regions[2].offset == 1024
    regions = _pack({1: (1024, 0, 0), 2: (1024, 0, 1), 3: (1024, 1, 1)})
    assert [regions[k].offset for k in (1, 2, 3)] == [0, 1024, 0]


def test_per_pair_counters_cover_every_column_tile(logged, monkeypatch):
    """On per-pair blocks (one token, Hopper patched in, two launches) the k-sum's counters
    hold one per token and 64-column tile of the output, the last partial tile included."""
    from mxfx.kernels import moe_sm90

    monkeypatch.setattr(moe_sm90, "runs_on", lambda device: True)
    inputs = _inputs(1, 0, H=160)
    moe._fused_moe(*inputs, GPT_OSS, ActivationQuant())
    (_, _, gemm1), (_, _, gemm2) = logged
    assert gemm1[-3] == gemm2[-3] == 3  # T * cdiv(160, 64)


@pytest.mark.parametrize("programs,steps,pdl", [(720, 6, True), (360, 23, False), (540, 23, True),
                                                (528, 23, False), (529, 23, True), (512, 28, False), (10, 8, True)])
def test_per_pair_gemm2_launched_by_pdl_when_short_or_many_per_sm(monkeypatch, programs, steps, pdl):
    """Per-pair GEMM2 is launched by PDL where its programs have at most 8 K steps or there
    are more than 4 per SM of 132."""
    monkeypatch.setattr(moe, "num_sms", lambda device: 132)
    assert moe._pdl_gemm2(programs, steps, torch.device("cpu")) == pdl
