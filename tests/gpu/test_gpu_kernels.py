"""The Triton MoE kernels on a CUDA/ROCm device, through the backends' entry points: bfloat16 at
model-sized and odd shapes (float16 and float32 at model size), activation quantization against
emulation, CUDA graphs, no host synchronisation, determinism, inputs on a GPU that is not the
current one, and NaN-poisoned padding around every input. Which Hopper kernel a call takes, and
that each is right: ``test_gpu_hopper.py``."""
from __future__ import annotations

import pytest
import torch

from moe_cases import check, gen, inputs, moe, rel_err, spy, unfused, weights
from mxfx import formats
from mxfx.activation import GPT_OSS, SILU_AND_MUL, GatedActivation, minimax_m3
from mxfx.backends import emulation
from mxfx.moe_call import ActivationQuant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device"),
]
moe_portable = pytest.importorskip("mxfx.kernels.moe_portable")


@pytest.mark.parametrize("fn", [moe.fused_moe, unfused], ids=["fused", "unfused"])
@pytest.mark.parametrize("T", [1, 8, 64, 300])
def test_gpt_oss_shape_bf16(fn, T):
    check(fn, T, 8, 2880, 2880, 4, torch.bfloat16, GPT_OSS)


@pytest.mark.parametrize(
    "T,E,H,I,k,act,kw",
    [
        (0, 4, 2880, 352, 4, GPT_OSS, {}),
        (5, 4, 2880, 352, 4, GPT_OSS, {}),  # k = E
        # Tensor-parallel shards of gpt-oss (I/32 is not whole: float weights only).
        (5, 4, 2880, 360, 4, GPT_OSS, {"quantized": False}),
        (33, 6, 2880, 720, 2, GPT_OSS, {"bias": False, "quantized": False}),
        (9, 4, 352, 2880, 2, GPT_OSS, {}),
        (17, 1, 352, 96, 1, minimax_m3(1.702, 1.0, 7.0), {}),  # E = 1
        (1000, 4, 160, 224, 1, SILU_AND_MUL, {"one_expert": True}),  # every token on expert 0
        (16, 8, 352, 2880, 1, GPT_OSS, {"one_expert": True}),  # 8-row blocks (Hopper): two for expert 0
        (40, 4, 200, 136, 2, GatedActivation("halves", 1.1, 0.3, 3.0), {"quantized": False}),
        (40, 4, 200, 136, 2, GPT_OSS, {"quantized": False, "transposed": True}),
    ],
)
@pytest.mark.parametrize("fn", [moe.fused_moe, unfused], ids=["fused", "unfused"])
def test_odd_shapes_bf16(fn, T, E, H, I, k, act, kw):
    check(fn, T, E, H, I, k, torch.bfloat16, act, **kw)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.float32, 1e-4)], ids=["fp16", "fp32"])
@pytest.mark.parametrize("quantized", [True, False], ids=["mxfp4", "float"])
@pytest.mark.parametrize("T", [1, 64, 300])
@pytest.mark.parametrize("fn", [moe.fused_moe, unfused], ids=["fused", "unfused"])
def test_float16_and_float32_activations_at_model_size(fn, T, quantized, dtype, tol):
    """float16 and float32 models at gpt-oss's sizes (the portable kernel: the Hopper kernels
    take bfloat16 only); float32 operands multiply in IEEE float32, not TF32."""
    check(fn, T, 8, 2880, 2880, 4, dtype, GPT_OSS, tol=tol, quantized=quantized)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_activation_quant_equals_emulation(fmt):
    aq = ActivationQuant(fmt, "even")
    # float32: equal up to accumulation order.
    out, ref, (x, tw, ids, W) = check(moe.fused_moe, 64, 8, 512, 384, 4, torch.float32, GPT_OSS,
                                        aq=aq, tol=1e-5)
    assert rel_err(ref, emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant())) > 1e-3
    # bfloat16 at the gpt-oss shape: far closer to the quantized reference than A16 is.
    out, ref, (x, tw, ids, W) = check(moe.fused_moe, 64, 8, 2880, 2880, 4, torch.bfloat16, GPT_OSS,
                                        aq=aq, tol=1e-2)
    gap = rel_err(ref, emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant()))
    assert rel_err(out, ref) < 0.2 * gap


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("T,E,H,I,dtype,tol", [(64, 8, 512, 384, torch.float32, 1e-5),
                                                (9, 4, 352, 224, torch.float32, 1e-5),
                                                (3, 8, 2880, 2880, torch.bfloat16, 1e-2),
                                                (200, 8, 2880, 2880, torch.bfloat16, 1e-2)])
def test_scaled_mma_path_equals_emulation(monkeypatch, fmt, T, E, H, I, dtype, tol):
    """The A8/A4 path of GPUs with MX matrix instructions (each GEMM input quantized into MX
    elements and scales, tl.dot_scaled), forced here, where Triton emulates the scaled MMA:
    in float32 equal to emulation up to accumulation order."""
    from mxfx.kernels import mx

    monkeypatch.setattr(mx, "native_scaled_mma", lambda device: True)
    monkeypatch.setattr(moe._FUSED, "_plans", {})
    seen = spy(monkeypatch, moe_portable.GEMM)
    check(moe.fused_moe, T, E, H, I, 4 if E == 8 else 2, dtype, GPT_OSS, aq=ActivationQuant(fmt, "even"), tol=tol)
    assert [m["A_FMT"] for m in seen] == [mx.FMT_CODES[fmt]] * 2


def test_qdq_and_dequant_bit_exact_bf16():
    from mxfx.kernels import mx

    g = gen(3)
    x = (torch.randn(64, 2880, generator=g, device="cuda") * 3).to(torch.bfloat16)
    for fmt in ("mxfp8", "mxfp4"):
        for r in ("floor", "round_up", "even"):
            out = mx.quantize_dequantize(x, fmt, r)
            assert torch.equal(out.view(torch.int16), formats.quantize_dequantize(x, fmt, r).view(torch.int16))
    p, s = formats.quantize(x.float(), "mxfp4", "round_up")
    assert torch.equal(mx.dequantize_mxfp4(p, s, torch.bfloat16), formats.dequantize(p, s, "mxfp4", torch.bfloat16))


@pytest.mark.parametrize("T", [24, 300])  # on Hopper 300 takes the warp-specialized kernel
@pytest.mark.parametrize("fn", [moe.fused_moe, unfused], ids=["fused", "unfused"])
def test_cuda_graph_no_sync_deterministic(fn, T):
    E, H, I, k = 16, 2880, 2880, 4
    W = weights(E, H, I, torch.bfloat16)
    x, tw, ids = inputs(T, H, E, k, torch.bfloat16, seed=1)
    x = x.clone()
    eager = fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(eager, again)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    x2, tw2, ids2 = inputs(T, H, E, k, torch.bfloat16, seed=2)
    x.copy_(x2)
    tw.copy_(tw2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn(x, tw, ids, W, GPT_OSS, ActivationQuant()))
    assert rel_err(out, emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant())) <= 5e-3


def test_backends_through_ops():
    """``torch.ops.mxfx.moe`` with the backend forced."""
    import mxfx  # noqa: F401
    E, H, I, k, T = 8, 2880, 2880, 4, 8
    W = weights(E, H, I, torch.bfloat16)
    x, tw, ids = inputs(T, H, E, k, torch.bfloat16, seed=5)
    ref = emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant())
    for name in ("triton", "triton_unfused"):
        out = torch.ops.mxfx.moe(x, tw, ids, W.w13, W.w13_scale, W.w13_bias, W.w2, W.w2_scale,
                                 W.w2_bias, "interleaved", 1.702, 1.0, 7.0, "none", name)
        assert rel_err(out, ref) <= 5e-3


@pytest.mark.parametrize("fused,T,aq", [(True, 1, "none"), (True, 9, "none"), (True, 200, "none"), (True, 5, "mxfp8"),
                                        (True, 0, "none"), (False, 1, "none"), (False, 200, "none")])
def test_replayed_calls_match_emulation(fused, T, aq):
    """After the first call of a signature, fused_moe and unfused_moe replay their launch plan
    with each call's addresses: every later call, with new inputs, must still match emulation."""
    E, H, I, k = 8, 352, 224, 2
    W = weights(E, H, I, torch.bfloat16)
    fn, replayer = (moe.fused_moe, moe._FUSED) if fused else (unfused, moe._UNFUSED)
    before = set(replayer._plans)
    for seed in range(3):
        x, tw, ids = inputs(T, H, E, k, torch.bfloat16, seed=seed)
        out = fn(x, tw, ids, W, GPT_OSS, ActivationQuant(aq))
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
        if T:
            assert rel_err(out, emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant(aq))) <= 5e-3
    (new,) = set(replayer._plans) - before
    assert not isinstance(replayer._plans[new], str), replayer._plans[new]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("T", [1, 64, 300])  # on Hopper: per pair, 8-row blocks, warp-specialized
@pytest.mark.parametrize("fn", [moe.fused_moe, unfused], ids=["fused", "unfused"])
def test_inputs_on_a_device_that_is_not_the_current_one(fn, T):
    """A layer on the second GPU while the first is current (as transformers' ``device_map``
    places layers): the kernels run on the inputs' device, in the call that records the launch
    plan and in the replays, and give what they give with that device current."""
    E, H, I, k = 16, 2880, 2880, 4
    with torch.cuda.device(1):
        W = weights(E, H, I, torch.bfloat16)
        x, tw, ids = inputs(T, H, E, k, torch.bfloat16, seed=3)
    assert torch.cuda.current_device() == 0
    outs = [fn(x, tw, ids, W, GPT_OSS, ActivationQuant()) for _ in range(2)]
    with torch.cuda.device(1):
        ref = fn(x, tw, ids, W, GPT_OSS, ActivationQuant())
    torch.cuda.synchronize(1)
    for out in outs:
        assert out.device == x.device and torch.equal(out, ref)
    assert rel_err(ref, emulation.moe(x, tw, ids, W, GPT_OSS, ActivationQuant())) <= 5e-3


@pytest.mark.parametrize("ids", [[[0, 1], [2, 4]], [[0, 4]]])
def test_expert_id_beyond_E_is_a_device_side_assert(ids):
    """No host synchronisation to check the ids: the routing kernel asserts on the device (for
    a single token, which has no routing kernel, GEMM1 does), which fails the process's CUDA
    context (so this runs in a subprocess)."""
    import subprocess
    import sys

    code = (
        "import torch, mxfx\n"
        "from mxfx.activation import GPT_OSS\n"
        "from mxfx.moe_call import ActivationQuant, MoEWeights\n"
        "from mxfx.kernels import moe\n"
        "E, H, I = 4, 64, 64\n"
        "w = MoEWeights(torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8, device='cuda'),\n"
        "               torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8, device='cuda'), None,\n"
        "               torch.zeros(E, H, I // 2, dtype=torch.uint8, device='cuda'),\n"
        "               torch.full((E, H, I // 32), 127, dtype=torch.uint8, device='cuda'), None)\n"
        f"ids = torch.tensor({ids}, dtype=torch.int32, device='cuda')\n"
        "x = torch.ones(len(ids), H, dtype=torch.bfloat16, device='cuda')\n"
        "moe.fused_moe(x, torch.ones(len(ids), 2, device='cuda'), ids, w, GPT_OSS, ActivationQuant())\n"
        "torch.cuda.synchronize()\n"
        "print('no error')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "no error" not in r.stdout
    assert "expert id >= E" in r.stdout + r.stderr
