"""``python -m mxfx bench``: MoE layer time against the roofline.

For each model shape, number of tokens T, activation quantization and backend, times one
``torch.ops.mxfx.moe`` call (routing preparation included) on random MXFP4 weights and
reports it against the roofline of that T:

    roofline = max(bytes ÷ copy bandwidth, FLOPs ÷ bf16 matmul rate)
    bytes    = MXFP4 weights + scales + biases of the distinct experts the routing hits,
               plus the activations read and the output written
    FLOPs    = 2 · T · k · (H · 2I + I · H)

Both ceilings are measured in the same run (a large device-to-device copy; an 8192³ bf16
matmul). Several routing sets (top-k of random logits) are rotated so that the weights are
not resident in L2. ``--routing balanced`` gives every expert the same number of rows instead
(T·k/E, ±1 where E does not divide it), so that a kernel's cost per row count shows without
the spread of random routing. On CUDA the time is the median over replays of a CUDA graph
holding one call per routing set; at T=1 the eager time per call is reported too (the per-call
overhead): the least of 3 medians of back-to-back calls, since host-side interference only adds
to it (it still varies from run to run: tools/PERF_LOG.md, session 39).
A torch baseline (dequantized bf16 weights, ``torch._grouped_mm``) is measured alongside.
Results go to stdout, a PNG plot (% of roofline against T) and ``PERF_LOG.md``.

``--quick`` runs a tiny shape on any device (CPU included) with wall-clock timing: a smoke
test of this harness, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

import mxfx.ops  # noqa: F401  (registers torch.ops.mxfx)
from mxfx import backends, formats
from mxfx.moe_call import MoEWeights
from mxfx.oracle import MoEConfig, Platform, supports
from mxfx.oracle.shapes import SHAPES

BASELINE = "torch_bf16"
ACT_QUANTS = ("none", "mxfp8", "mxfp4")
DEFAULT_T = (1, 8, 64, 512, 4096)
QUICK_T = (1, 8, 64)
# OpenAI triton_kernels (matmul_ogs, MXFP4, fused SwiGLU, CUDA graphs, routing included) on the
# gpt-oss-120b shape, measured on an H200 (issue 4): T -> µs.
TRITON_KERNELS_US = {1: 66.1, 8: 178.9, 64: 599.0, 512: 927.0, 4096: 2294.0}
TRITON_KERNELS_MODEL = "gpt-oss-120b"
TRITON_KERNELS_GPU = "H200"
QUICK_SHAPES = {"tiny": MoEConfig(4, 64, 96, 2, "interleaved", 1.702, 1.0, 7.0, has_bias=True)}
ROUTINGS = ("random", "balanced")
_ROUTING_SETS = 8  # × the experts one set touches: well past the 60 MB L2 of an H200
_DTYPE = torch.bfloat16
_DTYPE_BYTES = 2


@dataclass(frozen=True)
class Ceilings:
    """Measured device ceilings: copy bandwidth (bytes read + written per second) and matmul rate."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float


@dataclass(frozen=True)
class Row:
    """One measurement. Times in µs; ``pct`` = 100 · roofline_us / us."""

    model: str
    T: int
    act_quant: str
    backend: str
    us: float
    mode: str  # "graph" (CUDA graph replay), "eager" (back-to-back calls) or "wall" (CPU clock)
    eager_us: Optional[float]
    bytes: float
    flops: float
    roofline_us: float
    rel_err: Optional[float]  # ‖out − emulation‖ / ‖emulation‖ on the first routing set
    routing: str = "random"  # see ROUTINGS
    device: str = "cpu"  # the GPU's name (device_name) it ran on

    @property
    def mode_text(self) -> str:
        """``mode``, with the routing where it is not random."""
        return self.mode if self.routing == "random" else f"{self.mode}/{self.routing}"

    @property
    def pct(self) -> float:
        return 100.0 * self.roofline_us / self.us

    @property
    def tbps(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e12

    @property
    def tflops(self) -> float:
        return self.flops / (self.us * 1e-6) / 1e12


# ---------------------------------------------------------------------------- timing


def _median_seconds(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median of ``reps`` timings of ``fn``: CUDA events on a GPU, the host clock on CPU."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reps(estimate_s: float, budget_s: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(budget_s / max(estimate_s, 1e-7))))


def measure_ceilings(device: torch.device, quick: bool = False) -> Ceilings:
    """Copy bandwidth (a device-to-device copy, bytes read + written) and bf16 matmul rate
    (an 8192³ product of random matrices; 512³ with ``quick``), medians of several runs."""
    n_bytes = (64 << 20) if quick else (2 << 30)
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), device, 5 if quick else 20)
    n = 512 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=_DTYPE)
    b = torch.randn(n, n, device=device, dtype=_DTYPE)
    torch.mm(a, b)
    mm_s = _median_seconds(lambda: torch.mm(a, b), device, 3 if quick else 20)
    return Ceilings(2 * n_bytes / copy_s, 2 * n**3 / mm_s)


# ---------------------------------------------------------------------------- problem


def _random_weights(shape: MoEConfig, device: torch.device, gen: torch.Generator) -> MoEWeights:
    """Random MXFP4 experts: every FP4 code, scales near 2^-7 so layer outputs stay O(1)."""
    E, H, I = shape.num_experts, shape.hidden_size, shape.intermediate_size

    def codes(*size):
        return torch.randint(0, 256, size, dtype=torch.uint8, device=device, generator=gen)

    def scales(*size):
        return torch.randint(118, 123, size, dtype=torch.uint8, device=device, generator=gen)

    def bias(*size):
        if not shape.has_bias:
            return None
        return (0.1 * torch.randn(size, device=device, generator=gen)).to(_DTYPE)

    return MoEWeights(codes(E, 2 * I, H // 2), scales(E, 2 * I, H // 32), bias(E, 2 * I),
                      codes(E, H, I // 2), scales(E, H, I // 32), bias(E, H))


def _routing_sets(shape: MoEConfig, T: int, n: int, device: torch.device, gen: torch.Generator,
                  routing: str = "random"):
    """``n`` independent (x, topk_weights, topk_ids), softmax over the k. ``random``: top-k of
    random logits. ``balanced``: pair j of the T·k goes to expert π(j mod E) for a random
    permutation π, so each expert gets ⌊T·k/E⌋ or one more pairs, and a token's k are distinct
    where k ≤ E (every shape in SHAPES)."""
    E, k = shape.num_experts, shape.top_k
    sets = []
    for _ in range(n):
        logits = torch.randn(T, E, device=device, generator=gen)
        vals, ids = logits.topk(k, dim=-1)
        if routing == "balanced":
            perm = torch.randperm(E, device=device, generator=gen)
            ids = perm[torch.arange(T * k, device=device).reshape(T, k) % E]
        x = torch.randn(T, shape.hidden_size, device=device, generator=gen).to(_DTYPE)
        sets.append((x, torch.softmax(vals, dim=-1).to(_DTYPE), ids.to(torch.int32)))
    return sets


def touched_bytes(shape: MoEConfig, topk_ids: torch.Tensor) -> int:
    """Bytes a MoE call must move at least: the MXFP4 weights, scales and biases of the
    distinct experts in ``topk_ids`` (ids < 0 excluded), plus bf16 activations in and out."""
    E_hit = int(torch.unique(topk_ids[topk_ids >= 0]).numel())
    H, I = shape.hidden_size, shape.intermediate_size
    per_expert = (2 * I * H + H * I) // 2 + (2 * I * H + H * I) // 32
    if shape.has_bias:
        per_expert += (2 * I + H) * _DTYPE_BYTES
    return E_hit * per_expert + 2 * topk_ids.shape[0] * H * _DTYPE_BYTES


def moe_flops(shape: MoEConfig, T: int) -> int:
    """2 · T · k · (H · 2I + I · H): the two GEMMs of the routed (token, slot) pairs."""
    H, I = shape.hidden_size, shape.intermediate_size
    return 2 * T * shape.top_k * (H * 2 * I + I * H)


def roofline_seconds(bytes_: float, flops: float, c: Ceilings) -> float:
    return max(bytes_ / c.copy_bytes_per_s, flops / c.matmul_flops_per_s)


# ---------------------------------------------------------------------------- callers


def _mxfx_call(backend: str, shape: MoEConfig, w: MoEWeights, aq: str):
    act = shape.activation
    weights = (w.w13, w.w13_scale, w.w13_bias, w.w2, w.w2_scale, w.w2_bias)

    def call(x, tw, ids):
        return torch.ops.mxfx.moe(x, tw, ids, *weights, act.layout, act.alpha, act.beta, act.limit,
                                  aq, backend)

    return call


def _baseline_call(shape: MoEConfig, w: MoEWeights):
    """Dequantized bf16 experts through ``torch._grouped_mm``: what plain torch can do.
    Sorts the (token, slot) pairs by expert on the device (no host sync, graph-capturable)."""
    E = shape.num_experts
    w13 = torch.cat([formats.dequantize(w.w13[e : e + 1], w.w13_scale[e : e + 1], "mxfp4", _DTYPE)
                     for e in range(E)])
    w2 = torch.cat([formats.dequantize(w.w2[e : e + 1], w.w2_scale[e : e + 1], "mxfp4", _DTYPE)
                    for e in range(E)])
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] column-major, as grouped_mm wants
    act = shape.activation

    def call(x, tw, ids):
        T, k = ids.shape
        flat = ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        expert = flat[order]
        token = order // k
        counts = torch.zeros(E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, expert, torch.ones_like(expert, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        h = torch._grouped_mm(x[token], w13_t, offs=offs)
        if w.w13_bias is not None:
            h = h + w.w13_bias[expert]
        a = torch.ops.mxfx.gated_activation(h, act.layout, act.alpha, act.beta, act.limit)
        y = torch._grouped_mm(a, w2_t, offs=offs)
        if w.w2_bias is not None:
            y = y + w.w2_bias[expert]
        y = y.float() * tw.reshape(-1)[order].float().unsqueeze(1)
        return torch.zeros(T, x.shape[1], device=x.device).index_add_(0, token, y).to(x.dtype)

    return call


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _time_call(call, sets, device: torch.device, graph: bool, quick: bool) -> tuple[float, str]:
    """Seconds per call, and how they were measured. ``graph``: one CUDA graph of one call per
    routing set, replayed; else the calls back to back (eager)."""
    run_all = lambda: [call(*s) for s in sets]  # noqa: E731
    if device.type != "cuda":
        run_all()
        est = _median_seconds(run_all, device, 1)
        reps = 2 if quick else _reps(est, 0.5, 3, 20)
        return _median_seconds(run_all, device, reps) / len(sets), "wall"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, workspaces) off the capture stream
        run_all()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run_all()
        replay = g.replay
    else:
        replay = run_all
    replay()
    est = _median_seconds(replay, device, 3)
    return _median_seconds(replay, device, _reps(est, 0.3, 5, 100)) / len(sets), "graph" if graph else "eager"


# ---------------------------------------------------------------------------- driver


def device_name(device: torch.device) -> str:
    """The GPU's name as CUDA/ROCm reports it ("NVIDIA H200"), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_slug(gpu: str) -> str:
    """The plot's file-name part for a GPU: its name, vendor dropped, lowercase, runs of other
    characters as one "_" ("NVIDIA H100 80GB HBM3" -> "h100_80gb_hbm3", "NVIDIA H200" -> "h200")."""
    name = re.sub(r"^(nvidia|amd)\s+", "", gpu.strip().lower())
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def _refusal(name: str, config: MoEConfig, device: torch.device) -> Optional[str]:
    """Why backend ``name`` cannot run ``config`` here (the oracle's reason), or None."""
    if name == BASELINE:
        return None if config.activation_quant == "none" else "executes only activation_quant=none"
    ok, reason = supports(backends.get(name), config, Platform.current(device))
    return None if ok else reason


def run(
    models: dict[str, MoEConfig],
    Ts: Sequence[int],
    backend_names: Sequence[str],
    act_quants: Sequence[str],
    device: torch.device,
    quick: bool = False,
    check: bool = True,
    log: Callable[[str], None] = print,
    routing: str = "random",
) -> tuple[Ceilings, list[Row]]:
    """Measure every (model, T, act_quant, backend) that the oracle says the backend runs.

    ``models`` maps names to configs (bf16 activations, MXFP4 weights); ``backend_names`` are
    registered backends and/or :data:`BASELINE`. With ``check`` each output is compared with
    the emulation backend's on the first routing set (``Row.rel_err``). A backend whose call
    raises is logged as FAILED and skipped for the rest of that model and act quant.
    ``routing``: one of :data:`ROUTINGS` (see :func:`_routing_sets`).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing: got {routing!r}, expected one of {list(ROUTINGS)}")
    gen = torch.Generator(device=device).manual_seed(0)
    gpu = device_name(device)
    ceilings = measure_ceilings(device, quick)
    log(f"ceilings: copy {ceilings.copy_bytes_per_s / 1e12:.3f} TB/s, "
        f"bf16 matmul {ceilings.matmul_flops_per_s / 1e12:.1f} TFLOP/s")
    log(_HEADER)
    rows: list[Row] = []
    n_sets = 2 if quick else _ROUTING_SETS
    for model, shape in models.items():
        w = _random_weights(shape, device, gen)
        baseline = _baseline_call(shape, w) if BASELINE in backend_names else None
        skip: set[tuple[str, str]] = set()
        for aq in act_quants:
            for name in backend_names:
                reason = _refusal(name, dataclasses.replace(shape, activation_quant=aq), device)
                if reason is not None:
                    skip.add((name, aq))
                    log(f"skip {model} {aq} {name}: {reason}")
        for T in Ts:
            sets = _routing_sets(shape, T, n_sets, device, gen, routing)
            bytes_ = statistics.mean(touched_bytes(shape, s[2]) for s in sets)
            flops = moe_flops(shape, T)
            roof_us = roofline_seconds(bytes_, flops, ceilings) * 1e6
            for aq in act_quants:
                ref = None
                for name in backend_names:
                    if (name, aq) in skip:
                        continue
                    call = baseline if name == BASELINE else _mxfx_call(name, shape, w, aq)
                    # emulation synchronises with the host per expert: it cannot be captured.
                    graph = device.type == "cuda" and name != "emulation"
                    try:
                        out = call(*sets[0])
                        err = None
                        if check and name != "emulation":
                            if ref is None:
                                ref = _mxfx_call("emulation", shape, w, aq)(*sets[0])
                            err = _rel_err(out, ref)
                        sec, mode = _time_call(call, sets, device, graph, quick)
                        eager = None
                        if graph and T == 1:
                            eager = min(_time_call(call, sets, device, False, quick)[0] for _ in range(3)) * 1e6
                    except Exception as e:  # noqa: BLE001  (report, then measure the others)
                        skip.add((name, aq))
                        log(f"FAILED {model} {aq} T={T} {name}: {type(e).__name__}: {e}")
                        continue
                    row = Row(model, T, aq, name, sec * 1e6, mode, eager, bytes_, flops, roof_us, err, routing,
                              gpu)
                    rows.append(row)
                    log(format_row(row))
            del sets
        del w, baseline
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return ceilings, rows


_HEADER = (f"{'model':<14} {'act':<5} {'T':>5} {'backend':<15} {'µs':>9} {'mode':<5} "
           f"{'eager µs':>9} {'roof µs':>8} {'% roof':>6} {'TB/s':>6} {'TFLOP/s':>8} {'rel err':>8} "
           f"{'tk µs':>7} {'tk %':>5}")


def format_row(r: Row) -> str:
    tk = TRITON_KERNELS_US.get(r.T) if _triton_kernels_comparable(r) else None
    tk_us = f"{tk:7.1f}" if tk else f"{'-':>7}"
    tk_pct = f"{100 * r.roofline_us / tk:5.0f}" if tk else f"{'-':>5}"
    eager = f"{r.eager_us:9.1f}" if r.eager_us is not None else f"{'-':>9}"
    err = f"{r.rel_err:8.1e}" if r.rel_err is not None else f"{'-':>8}"
    # Sub-µs rooflines (tiny shapes on a GPU) keep their significant digits.
    roof = f"{r.roofline_us:8.1f}" if r.roofline_us >= 1 else f"{r.roofline_us:8.2g}"
    return (f"{r.model:<14} {r.act_quant:<5} {r.T:>5} {r.backend:<15} {r.us:9.1f} {r.mode_text:<5} {eager} "
            f"{roof} {r.pct:6.1f} {r.tbps:6.2f} {r.tflops:8.1f} {err} {tk_us} {tk_pct}")


def _triton_kernels_comparable(r: Row) -> bool:
    """Whether the issue's triton_kernels figures were measured the way ``r`` was, on the same
    kind of GPU (another GPU's roofline over them would mean nothing)."""
    return (r.model == TRITON_KERNELS_MODEL and r.act_quant == "none" and r.routing == "random"
            and TRITON_KERNELS_GPU in r.device.split())


def format_table(rows: Sequence[Row]) -> str:
    """The rows under a header; ``tk`` columns: triton_kernels on an H200 (issue 4), gpt-oss-120b."""
    return "\n".join([_HEADER, *(format_row(r) for r in rows)])


def write_plot(rows: Sequence[Row], path: Path, title: str) -> None:
    """% of roofline against T (log x), one panel per model (and routing), one line per backend
    and act quant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.model, r.routing) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, routing) in zip(axes[0], panels):
        mine = [r for r in rows if (r.model, r.routing) == (model, routing)]
        for key in dict.fromkeys((r.backend, r.act_quant) for r in mine):
            pts = sorted((r.T, r.pct) for r in mine if (r.backend, r.act_quant) == key)
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]} (A{_act_bits(key[1])})")
        if model == TRITON_KERNELS_MODEL:
            ref = sorted((r.T, 100 * r.roofline_us / TRITON_KERNELS_US[r.T]) for r in mine
                         if r.T in TRITON_KERNELS_US and _triton_kernels_comparable(r))
            ref = list(dict.fromkeys(ref))
            if ref:
                ax.plot(*zip(*ref), "k--", marker="x", label="triton_kernels (issue 4)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("% of roofline")
        ax.set_title(model if routing == "random" else f"{model}, {routing} routing")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _act_bits(aq: str) -> str:
    return {"none": "16", "mxfp8": "8", "mxfp4": "4"}[aq]


_LOG_HEADER = ("# MoE benchmark log\n\nAppended by `python -m mxfx bench` (tools/bench_moe.py). "
               "% roof = roofline ÷ measured time.\n\n"
               "| date (UTC) | rev | device | model | act | T | backend | µs | mode | % roof |\n"
               "|---|---|---|---|---|---|---|---|---|---|\n")


def append_perf_log(rows: Sequence[Row], path: Path, rev: str) -> None:
    """Append one line per row to the Markdown table at ``path`` (created with a header)."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    lines = [f"| {date} | {rev} | {r.device} | {r.model} | {r.act_quant} | {r.T} | {r.backend} | "
             f"{r.us:.1f} | {r.mode_text} | {r.pct:.1f} |\n" for r in rows]
    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write(_LOG_HEADER)
        f.writelines(lines)


def git_revision(repo: Path) -> str:
    """``git rev-parse --short HEAD`` plus ``-dirty`` when the tree has changes; ``unknown``
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def _csv(kind: Callable, choices: Optional[Sequence] = None):
    def parse(text: str):
        items = [kind(t) for t in text.split(",") if t]
        bad = [t for t in items if choices is not None and t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"got {text!r}, expected a comma list of {list(choices or [])}")
        return items

    return parse


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line of ``python -m mxfx bench`` / ``tools/bench_moe.py``."""
    repo = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(prog="python -m mxfx bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_csv(str, [*SHAPES, *QUICK_SHAPES]), help="comma list (default: all)")
    p.add_argument("--T", type=_csv(int), help=f"comma list of token counts (default {DEFAULT_T})")
    p.add_argument("--backend", type=_csv(str, [*backends.names(), BASELINE]),
                   help=f"comma list of backends and {BASELINE!r} (default: every registered "
                   "backend but emulation, and the baseline)")
    p.add_argument("--act-quant", type=_csv(str, ACT_QUANTS), default=list(ACT_QUANTS))
    p.add_argument("--routing", choices=ROUTINGS, default="random",
                   help="top-k of random logits, or the same number of rows for every expert")
    p.add_argument("--quick", action="store_true", help="tiny shape, emulation + baseline, any device")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the comparison with emulation")
    p.add_argument("--out", type=Path, default=repo / "tools" if (repo / "tools").is_dir() else Path("."),
                   help="where the PNG and PERF_LOG.md go (default: the checkout's tools/)")
    p.add_argument("--rev", default=None, help="version to log (default: git rev-parse + dirty flag)")
    a = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {**SHAPES, **QUICK_SHAPES}
    if a.quick:
        models = {m: shapes[m] for m in (a.model or QUICK_SHAPES)}
        names = a.backend or ["emulation", BASELINE]
        Ts = a.T or list(QUICK_T)
    else:
        if device.type != "cuda":
            p.error("without a GPU only --quick runs (a tiny smoke test)")
        models = {m: shapes[m] for m in (a.model or SHAPES)}
        names = a.backend or [*(b for b in backends.names() if b != "emulation"), BASELINE]
        Ts = a.T or list(DEFAULT_T)
    gpu = device_name(device)
    rev = a.rev or git_revision(repo)
    print(f"mxfx bench: {gpu}, rev {rev}, torch {torch.__version__}")
    _, rows = run(models, Ts, names, a.act_quant, device, quick=a.quick, check=a.check,
                  log=lambda s: print(s, flush=True), routing=a.routing)
    print()
    print(format_table(rows))
    if not rows:
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_moe_" + ("quick" if a.quick else device_slug(gpu))
    write_plot(rows, a.out / f"{stem}.png", f"mxfx MoE bench, {gpu}, rev {rev}")
    append_perf_log(rows, a.out / "PERF_LOG.md", rev)
    print(f"wrote {a.out / f'{stem}.png'} and appended {len(rows)} rows to {a.out / 'PERF_LOG.md'}")
    return 0
