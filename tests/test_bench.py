"""The MoE benchmark harness (``python -m mxfx bench``) in its CPU smoke mode.

Checks the arithmetic (bytes, FLOPs, roofline, % of roofline) and that a run prints sane
rows and writes its PNG and PERF_LOG.md where it is told (a tmp dir, never the repo's).
"""
from __future__ import annotations

import re
import subprocess
import types

import pytest
import torch

from mxfx import bench
from mxfx.__main__ import main as cli_main
from mxfx.oracle import MoEConfig

TINY = bench.QUICK_SHAPES["tiny"]  # E=4 H=64 I=96 top-2, biases


def test_touched_bytes_counts_distinct_experts_and_activations():
    ids = torch.tensor([[0, 1], [1, -1], [1, 0]])
    per_expert = (2 * 96 * 64 + 64 * 96) // 2 + (2 * 96 * 64 + 64 * 96) // 32 + (2 * 96 + 64) * 2
    assert per_expert == 9216 + 576 + 512
    assert bench.touched_bytes(TINY, ids) == 2 * per_expert + 2 * 3 * 64 * 2
    no_bias = MoEConfig(4, 64, 96, 2)
    assert bench.touched_bytes(no_bias, torch.tensor([[3, 2]])) == 2 * (9216 + 576) + 2 * 64 * 2


def test_flops_and_roofline():
    assert bench.moe_flops(TINY, 3) == 2 * 3 * 2 * (64 * 192 + 96 * 64)
    c = bench.Ceilings(copy_bytes_per_s=4e12, matmul_flops_per_s=700e12)
    assert bench.roofline_seconds(8e6, 1e9, c) == pytest.approx(2e-6)  # memory bound
    assert bench.roofline_seconds(8e3, 7e9, c) == pytest.approx(1e-5)  # compute bound


def test_run_rows_are_consistent():
    models = {"tiny": TINY}
    ceilings, rows = bench.run(models, [1, 8], ["emulation", bench.BASELINE], ["none", "mxfp8"],
                               torch.device("cpu"), quick=True, log=lambda s: None)
    assert ceilings.copy_bytes_per_s > 0 and ceilings.matmul_flops_per_s > 0
    # the baseline runs only A16; emulation every act quant
    got = sorted((r.T, r.act_quant, r.backend) for r in rows)
    assert got == sorted([(T, aq, "emulation") for T in (1, 8) for aq in ("none", "mxfp8")]
                         + [(T, "none", bench.BASELINE) for T in (1, 8)])
    for r in rows:
        assert r.us > 0 and r.mode == "wall" and r.eager_us is None
        assert r.flops == bench.moe_flops(TINY, r.T)
        assert 2 * r.T * 64 * 2 < r.bytes <= 4 * (9216 + 576 + 512) + 2 * r.T * 64 * 2
        roof = bench.roofline_seconds(r.bytes, r.flops, ceilings) * 1e6
        assert r.roofline_us == pytest.approx(roof)
        assert r.pct == pytest.approx(100 * roof / r.us)
        assert r.tbps == pytest.approx(r.bytes / r.us / 1e6)
        if r.backend == bench.BASELINE:
            assert r.rel_err is not None and r.rel_err < 2e-2  # bf16 GEMMs vs float32 emulation
        else:
            assert r.rel_err is None


def test_cli_quick_writes_plot_and_log(tmp_path, capsys):
    args = ["bench", "--quick", "--T", "1,8", "--act-quant", "none", "--out", str(tmp_path),
            "--rev", "abc123"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines() if line.startswith("tiny ")]
    assert len(rows) == 2 * 2 * 2  # (T=1, 8) × (emulation, baseline), once as measured, once in the table
    for cols in rows:
        assert len(cols) == 14  # missing values print as "-"
        us, roof_us, pct = float(cols[4]), float(cols[7]), float(cols[8])
        assert us > 0 and roof_us > 0
        assert pct == pytest.approx(100 * roof_us / us, rel=0.02, abs=0.1)
    png = tmp_path / "bench_moe_quick.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (tmp_path / "PERF_LOG.md").read_text()
    lines = [ln for ln in log.splitlines() if re.match(r"\| \d{4}-\d\d-\d\d", ln)]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    assert len(lines) == 4 and all(f"| abc123 | {device} | tiny | none |" in ln for ln in lines)
    assert cli_main(args) == 0  # a second run appends under the same header
    log = (tmp_path / "PERF_LOG.md").read_text()
    assert log.count("| date (UTC) |") == 1
    assert len([ln for ln in log.splitlines() if re.match(r"\| \d{4}-\d\d-\d\d", ln)]) == 8


@pytest.mark.parametrize("T", [1, 6, 9])
def test_balanced_routing_gives_every_expert_the_same_rows(T):
    gen = torch.Generator().manual_seed(0)
    shape = MoEConfig(8, 64, 96, 3)
    sets = bench._routing_sets(shape, T, 3, torch.device("cpu"), gen, "balanced")
    seen = set()
    for x, tw, ids in sets:
        assert ids.shape == (T, 3) and ids.dtype == torch.int32 and tw.shape == (T, 3)
        assert all(len(set(row.tolist())) == 3 for row in ids)  # a token's experts are distinct
        counts = torch.bincount(ids.flatten().long(), minlength=8)
        assert counts.sum() == 3 * T and counts.max() - counts.min() <= 1
        assert counts.max() == -(-3 * T // 8)
        seen.add(tuple(ids.flatten().tolist()))
    assert len(seen) > 1  # each set permutes the experts afresh


def test_cli_balanced_routing_is_labelled(tmp_path, capsys):
    args = ["bench", "--quick", "--T", "8", "--act-quant", "none", "--backend", "emulation", "--routing",
            "balanced", "--out", str(tmp_path), "--rev", "abc123"]
    assert cli_main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("tiny ")]
    mode = "eager" if torch.cuda.is_available() else "wall"  # emulation is never captured in a graph
    assert len(rows) == 2 and all(cols[5] == f"{mode}/balanced" for cols in rows)
    log = (tmp_path / "PERF_LOG.md").read_text()
    assert "| tiny | none | 8 | emulation |" in log and f"| {mode}/balanced |" in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour: with a GPU a full run starts")
def test_full_run_needs_a_gpu(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path)])


def test_run_rejects_an_unknown_routing():
    with pytest.raises(ValueError, match="routing: got 'zipf'"):
        bench.run({"tiny": TINY}, [1], ["emulation"], ["none"], torch.device("cpu"), quick=True,
                  log=lambda s: None, routing="zipf")


def test_rejects_unknown_names(tmp_path):
    for bad in (["--model", "gpt-5"], ["--backend", "cutlass"], ["--act-quant", "mxfp6"], ["--routing", "zipf"]):
        with pytest.raises(SystemExit):
            bench.main(["--quick", "--out", str(tmp_path), *bad])


@pytest.mark.parametrize("name,slug", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100_80gb_hbm3"),
                                       ("AMD Instinct MI300X", "instinct_mi300x"),
                                       ("NVIDIA GeForce RTX 4090", "geforce_rtx_4090")])
def test_plot_file_names_the_whole_device(name, slug):
    """The plot's file says which GPU: the last word alone named an H100's plot "hbm3"."""
    assert bench.device_slug(name) == slug


@pytest.mark.parametrize("gpu,act_quant,routing,shown", [
    ("NVIDIA H200", "none", "random", True), ("NVIDIA H200 NVL", "none", "random", True),
    ("NVIDIA H100 80GB HBM3", "none", "random", False), ("cpu", "none", "random", False),
    ("NVIDIA H200", "mxfp8", "random", False), ("NVIDIA H200", "mxfp4", "random", False),
    ("NVIDIA H200", "none", "balanced", False)])
def test_triton_kernels_columns_only_beside_an_h200_a16_random_run(gpu, act_quant, routing, shown):
    """The issue's triton_kernels µs were measured on an H200 with bf16 activations and random
    routing: beside a gpt-oss-120b row from another GPU (whose roofline differs), with quantized
    activations or balanced routing (a different problem), the table leaves its columns empty."""
    row = bench.Row("gpt-oss-120b", 64, act_quant, "triton", 600.0, "graph", None, 1e9, 1e12, 450.0, None,
                    routing=routing, device=gpu)
    cols = bench.format_row(row).split()
    tk_us, tk_pct = cols[-2:]
    if shown:
        assert (float(tk_us), float(tk_pct)) == (bench.TRITON_KERNELS_US[64], round(100 * 450.0 / 599.0))
    else:
        assert (tk_us, tk_pct) == ("-", "-")
    assert cols[3:5] == ["triton", "600.0"]


def test_ceilings_count_copy_bytes_read_and_written_and_two_flops_per_multiply_add(monkeypatch):
    """The copy ceiling counts each byte twice (read and written) and the matmul ceiling two
    FLOPs per multiply-add of the n³ product: with every timing 0.5 s, the quick sizes
    (64 MiB, 512³) give 2·64 MiB / 0.5 s and 2·512³ / 0.5 s."""
    monkeypatch.setattr(bench, "_median_seconds", lambda fn, device, reps: 0.5)
    c = bench.measure_ceilings(torch.device("cpu"), quick=True)
    assert c.copy_bytes_per_s == pytest.approx(2 * 64 * 2**20 / 0.5)
    assert c.matmul_flops_per_s == pytest.approx(2 * 512**3 / 0.5)


def test_row_bytes_are_the_mean_over_the_routing_sets(monkeypatch):
    """Each routing set touches its own experts; a row's bytes (and so its roofline) are the
    mean over the sets: here 2 and 4 distinct experts, so 3 experts' weights on average."""
    real = bench._routing_sets

    def routed(shape, T, n, device, gen, routing="random"):
        sets = real(shape, T, n, device, gen, routing)
        ids = [torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0, 1], [2, 3]])]
        return [(x, tw, ids[i % 2].to(torch.int32)) for i, (x, tw, _) in enumerate(sets)]

    monkeypatch.setattr(bench, "_routing_sets", routed)
    _, rows = bench.run({"tiny": TINY}, [2], ["emulation"], ["none"], torch.device("cpu"), quick=True,
                        check=False, log=lambda s: None)
    (row,) = rows
    per_expert = (2 * 96 * 64 + 64 * 96) // 2 + (2 * 96 * 64 + 64 * 96) // 32 + (2 * 96 + 64) * 2
    activations = 2 * 2 * 64 * 2  # x in and y out, T=2 rows of H=64 bf16
    assert row.bytes == pytest.approx(3 * per_expert + activations)


def test_throughput_columns():
    """TB/s is bytes per second and TFLOP/s FLOPs per second, both over the measured time:
    1e9 bytes and 1e12 FLOPs in 500 µs are 2 TB/s and 2000 TFLOP/s."""
    row = bench.Row("tiny", 8, "none", "emulation", 500.0, "wall", None, 1e9, 1e12, 100.0, None)
    assert row.tbps == pytest.approx(2.0)
    assert row.tflops == pytest.approx(2000.0)
    cols = bench.format_row(row).split()
    assert (float(cols[8]), float(cols[9]), float(cols[10])) == (20.0, 2.0, 2000.0)  # % roof, TB/s, TFLOP/s


def test_wall_time_is_per_call(monkeypatch):
    """The timed block calls the layer once per routing set; the reported time is per call."""
    calls = []
    monkeypatch.setattr(bench, "_median_seconds", lambda fn, device, reps: 6.0)
    sec, mode = bench._time_call(lambda *s: calls.append(s), [(1,), (2,), (3,)], torch.device("cpu"),
                                 graph=False, quick=True)
    assert (sec, mode) == (2.0, "wall")
    assert calls == [(1,), (2,), (3,)]  # the warm-up ran each set once


def test_host_timing_is_the_median(monkeypatch):
    """One slow outlier among the repetitions does not move the time: the median is taken."""
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 30.0])  # durations 3, 1, 10
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert bench._median_seconds(lambda: None, torch.device("cpu"), 3) == 3.0


def test_perf_log_row_holds_time_mode_and_percent_of_roofline(tmp_path):
    """A PERF_LOG line carries the measured µs and % roof = 100 · roofline ÷ time
    (100 µs of roofline in 400 µs: 25.0)."""
    row = bench.Row("tiny", 8, "mxfp8", "emulation", 400.0, "wall", None, 1e6, 1e9, 100.0, None,
                    routing="balanced", device="cpu")
    bench.append_perf_log([row], tmp_path / "PERF_LOG.md", "abc123")
    line = (tmp_path / "PERF_LOG.md").read_text().splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:] == ["abc123", "cpu", "tiny", "mxfp8", "8", "emulation", "400.0", "wall/balanced", "25.0"]


def test_plot_draws_percent_of_roofline(tmp_path, monkeypatch):
    """Each backend's line is % of roofline against T; on gpt-oss-120b from an H200 the
    triton_kernels line is the same roofline over the issue's µs."""
    import matplotlib.axes

    drawn = []
    real_plot = matplotlib.axes.Axes.plot

    def plot(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), [float(v) for v in args[0]], [float(v) for v in args[1]]))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    rows = [bench.Row("gpt-oss-120b", T, "none", "triton", us, "graph", None, 1e9, 1e12, roof, None,
                      device="NVIDIA H200")
            for T, us, roof in ((1, 200.0, 50.0), (64, 1000.0, 599.0))]
    bench.write_plot(rows, tmp_path / "p.png", "t")
    lines = {label: (xs, ys) for label, xs, ys in drawn}
    assert lines["triton (A16)"] == ([1.0, 64.0], [25.0, 59.9])
    tk = lines["triton_kernels (issue 4)"]
    assert tk[0] == [1.0, 64.0]
    assert tk[1] == pytest.approx([100 * 50.0 / 66.1, 100.0])


def test_logged_revision_says_when_the_tree_has_changes(tmp_path):
    """The revision logged with a run is the short HEAD, with "-dirty" when the checkout has
    uncommitted changes, so that a PERF_LOG row is not credited to a commit it did not run."""
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("A = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "a")
    head = git("rev-parse", "--short", "HEAD")
    assert bench.git_revision(tmp_path) == head
    (tmp_path / "a.py").write_text("A = 2\n")
    assert bench.git_revision(tmp_path) == head + "-dirty"
    assert bench.git_revision(tmp_path / "nowhere") == "unknown"
