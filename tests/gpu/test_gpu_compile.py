"""The lowering on CUDA: the demo's gpt-oss model, its experts in MXFP4 (``mxfx.quantize_``),
compiled with mxfx runs ``mxfx.moe`` on the triton backend, in Inductor's default mode and under
Inductor's CUDA graphs (``mode="reduce-overhead"``, as gpt-fast compiles: the first call runs
eagerly, the second is captured, later ones replay with new tokens). On the CPU (emulation,
where Inductor makes no graphs) the same steps run in CI. And the eager path's persistent
counters stay out of the graphs' private memory pool."""
from __future__ import annotations

import pytest
import torch

import mxfx
from mxfx import lowering
from mxfx.demo import _no_compile_caches, build_model
from mxfx.kernels import moe

pytest.importorskip("transformers")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _logits(model, batches, mode=None) -> list[torch.Tensor]:
    """Each batch's logits (copied: CUDA graph outputs are overwritten by the next replay), by
    ``model`` compiled with mxfx enabled, the compile caches off so that the pass runs."""
    torch._dynamo.reset()
    lowering.clear()
    with _no_compile_caches(), mxfx.enabled():
        compiled = torch.compile(model, mode=mode)
        return [compiled(b).logits.clone() for b in batches]


@pytest.mark.parametrize("device, backend", [("cpu", "emulation"), pytest.param("cuda", "triton", marks=CUDA)])
def test_compiled_mxfp4_model_runs_the_backend_with_and_without_cuda_graphs(device, backend):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model("gpt-oss", device, dtype)
    mxfx.quantize_(model)
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (1, 12), device=device, generator=gen) for _ in range(4)]
    with torch.no_grad():
        eager = [model(b).logits for b in batches]
        plain = _logits(model, batches)
        moe_plain = [r for r in lowering.report() if r.form == "grouped_mm"]
        graphs = _logits(model, batches, mode="reduce-overhead")
        moe_graphs = [r for r in lowering.report() if r.form == "grouped_mm"]
    for records in (moe_plain, moe_graphs):
        assert len(records) == model.config.num_hidden_layers
        assert all(r.rewritten and r.backend == backend for r in records), [str(r) for r in records]
    for e, p, g in zip(eager, plain, graphs):
        assert torch.isfinite(p).all()
        assert _rel(p, e) < (3e-2 if dtype == torch.bfloat16 else 1e-4)
        # The same kernels, launched from a graph: the same logits, to the bit.
        assert torch.equal(g, p)


@pytest.mark.parametrize("device, backend", [("cpu", "emulation"), pytest.param("cuda", "triton", marks=CUDA)])
def test_generate_with_a_static_cache_under_cuda_graphs(device, backend):
    """transformers' ``generate`` with a static KV cache on the MXFP4 model, mxfx enabled:
    compiled by us in Inductor's default mode and under its CUDA graphs (the prefill and the
    decode step two graphs of one tree), the same tokens and logits to the bit, the prefill's
    logits as eager's; and compiled by transformers itself, as it does for static caches on GPUs
    (the decode step only, under CUDA graphs), the first decode step's logits as eager's. Every
    compile runs the backend. Where we compile the prefill, the cache is allocated before
    ``generate`` (``early_initialization``, as transformers asks for a compiled prefill): left to
    allocate itself inside the compiled prefill under CUDA graphs, it crashes torch 2.11 (SIGSEGV
    in an Inductor kernel launch) with or without mxfx, float model too (session 49)."""
    from transformers import CompileConfig, StaticCache

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    model = build_model("gpt-oss", device, dtype)
    mxfx.quantize_(model)
    gen = torch.Generator(device=device).manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (2, 12), device=device, generator=gen)
    greedy = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)

    def cache() -> StaticCache:
        c = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + greedy["max_new_tokens"])
        c.early_initialization(prompt.shape[0], model.config.num_key_value_heads, model.config.head_dim,
                               dtype, prompt.device)
        return c

    own = CompileConfig()
    own._compile_all_devices = True  # transformers' switch to compile on a CPU too
    forward, runs = model.forward, {}
    with torch.no_grad():
        eager = model.generate(prompt, disable_compile=True, cache_implementation="static", **greedy)
        for mode in (None, "reduce-overhead", "transformers"):
            torch._dynamo.reset()
            lowering.clear()
            with _no_compile_caches(), mxfx.enabled():
                if mode == "transformers":
                    runs[mode] = model.generate(prompt, compile_config=own, cache_implementation="static", **greedy)
                else:
                    model.forward = torch.compile(forward, mode=mode)
                    runs[mode] = model.generate(prompt, disable_compile=True, past_key_values=cache(), **greedy)
                    model.forward = forward
            # Which experts implementation transformers picks depends on the call (on CUDA its own
            # compile of the decode step takes batched_mm): every MoE form counts.
            records = [r for r in lowering.report() if r.form != "gated_activation"]
            assert len(records) >= model.config.num_hidden_layers, (mode, [str(r) for r in lowering.report()])
            assert all(r.rewritten and r.backend == backend for r in records), [str(r) for r in records]
    plain, graphs, own_run = runs[None], runs["reduce-overhead"], runs["transformers"]
    assert _rel(plain.logits[0], eager.logits[0]) < tol
    assert torch.equal(graphs.sequences, plain.sequences)
    assert all(torch.equal(g, p) for g, p in zip(graphs.logits, plain.logits))
    assert torch.equal(own_run.logits[0], eager.logits[0])  # transformers runs the prefill eagerly
    assert _rel(own_run.logits[1], eager.logits[1]) < tol


@CUDA
def test_mxfp4_model_compiled_without_mxfx_under_cuda_graphs():
    """``mxfx.quantize_``'s experts compiled without mxfx enabled dequantize their weights in
    the graph (``mxfx.dequantize_mx``), which a CUDA graph capture must accept."""
    model = build_model("gpt-oss", "cuda", torch.bfloat16)
    mxfx.quantize_(model)
    gen = torch.Generator(device="cuda").manual_seed(3)
    batches = [torch.randint(0, model.config.vocab_size, (1, 12), device="cuda", generator=gen) for _ in range(3)]
    torch._dynamo.reset()
    with torch.no_grad(), _no_compile_caches():
        compiled = torch.compile(model, mode="reduce-overhead")
        for b in batches:
            assert _rel(compiled(b).logits, model(b).logits) < 3e-2


@CUDA
def test_eager_counters_stay_out_of_the_private_pool_the_thread_allocates_to(monkeypatch):
    """``moe._sync_buffer``'s counters, first asked for while this thread's allocations go to a
    private pool (as while Inductor's CUDA graph trees warm up), come from the ordinary pool:
    the counters are kept across calls, and the trees raise on a live block of their pool that
    is not one of their outputs."""
    monkeypatch.setattr(moe, "_sync", {})  # no stream has counters yet (torch pools its streams)
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda")
    pool = torch.cuda.MemPool()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool):
        control = torch.empty(1024, device="cuda")
        counters = moe._sync_buffer(x)
    stream.synchronize()

    def pool_of(t: torch.Tensor) -> tuple[int, int]:
        [segment] = [s for s in torch.cuda.memory_snapshot()
                     if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]]
        return tuple(segment["segment_pool_id"])

    assert pool_of(control) == tuple(pool.id)  # the check sees the private pool
    assert pool_of(counters) != tuple(pool.id)
    assert not counters.any()
