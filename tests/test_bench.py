"""benchmark(), numerics.compare(), overlap_report() and the `commgemm bench | info` CLI."""

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cpu_env, load_script

import commgemm as cg
from commgemm.bench import timing
from commgemm.cli import args, main
from commgemm.cli.specs import parse_method


def test_benchmark_fields_consistent():
    f = jax.jit(lambda a: jnp.tanh(a @ a))
    r = cg.bench.benchmark(f, jnp.ones((128, 128)), iters=12, warmup=2)
    assert r.min <= r.median <= r.max
    assert r.p95 <= r.p99 <= r.max and r.min <= r.mean <= r.max
    assert r.stdev >= 0 and len(r.samples) == 12 and all(s > 0 for s in r.samples)
    assert "median=" in repr(r)


def test_benchmark_groups_calls():
    """Each sample averages `group` calls: the function runs warmup + iters * group + 1 times and
    the samples' sum is the wall time between the first and last timed completions."""
    jitted = jax.jit(lambda a: jnp.tanh(a @ a))
    calls = []

    def f(a):
        calls.append(1)
        return jitted(a)

    start = time.perf_counter()
    r = cg.bench.benchmark(f, jnp.ones((64, 64)), iters=5, warmup=2, group=3)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    assert len(calls) == 2 + 5 * 3 + 1 and len(r.samples) == 5 and r.group == 3
    assert 0 < sum(r.samples) * 3 <= elapsed_ms


def _logged_variants(names, log):
    jitted = jax.jit(lambda a: jnp.tanh(a @ a))

    def variant(name):
        def f(a):
            log.append(name)
            return jitted(a)

        return f, (jnp.ones((64, 64)),)

    return {n: variant(n) for n in names}


def test_benchmark_interleaved_cycles_through_variants(monkeypatch):
    """Every cycle takes one sample (head + group calls) of each variant, in an order that
    changes between cycles; each variant gets `iters` samples whose sum fits in the elapsed
    time. (Start marks are made to look pending, so no sample is retried.)"""
    monkeypatch.setattr(timing, "_is_ready", lambda out: False)
    log: list[str] = []
    names = ["a", "b", "c"]
    start = time.perf_counter()
    results = cg.bench.benchmark_interleaved(
        _logged_variants(names, log), iters=6, warmup=1, group=2
    )
    elapsed_ms = (time.perf_counter() - start) * 1e3
    assert list(results) == names
    timed = log[len(names) :]  # after one warm-up call each
    assert len(timed) == 6 * 3 * (1 + 2)
    blocks = [timed[i] for i in range(0, len(timed), 3)]  # one name per sample
    assert all(timed[i : i + 3] == [blocks[i // 3]] * 3 for i in range(0, len(timed), 3))
    cycles = [tuple(blocks[i : i + 3]) for i in range(0, len(blocks), 3)]
    assert all(sorted(c) == names for c in cycles) and len(set(cycles)) > 1
    for r in results.values():
        assert len(r.samples) == 6 and r.group == 2 and r.head == 1 and not r.dispatch_bound
        assert r.dispatch_ms > 0
    assert 0 < sum(sum(r.samples) * 2 for r in results.values()) <= elapsed_ms
    with pytest.raises(ValueError, match="variants is empty"):
        cg.bench.benchmark_interleaved({})
    with pytest.raises(ValueError, match="iters=1"):
        cg.bench.benchmark_interleaved(_logged_variants(["a"], []), iters=1)


def test_benchmark_interleaved_enqueues_more_ahead_when_the_mark_is_early(monkeypatch):
    """A start mark already complete when the group is enqueued would be taken late: that
    sample is dropped and the head doubles, up to MAX_HEAD, past which it is dispatch-bound."""
    monkeypatch.setattr(timing, "_is_ready", lambda out: True)
    log: list[str] = []
    results = cg.bench.benchmark_interleaved(
        _logged_variants(["a"], log), iters=3, warmup=1, group=2
    )
    r = results["a"]
    assert r.head == timing.MAX_HEAD and r.dispatch_bound and len(r.samples) == 3
    tries = [h + 2 for h in (1, 2, 4, 8, 16)] + [16 + 2] * 2
    assert len(log) == 1 + sum(tries)


def test_benchmark_rejects_bad_arguments():
    f = jax.jit(lambda a: a)
    with pytest.raises(ValueError, match="iters=1"):
        cg.bench.benchmark(f, jnp.ones(2), iters=1)
    with pytest.raises(ValueError, match="warmup=0"):
        cg.bench.benchmark(f, jnp.ones(2), warmup=0)
    with pytest.raises(ValueError, match="group=0"):
        cg.bench.benchmark(f, jnp.ones(2), group=0)


def test_compare_finds_worst_element_and_bad_region(rng):
    ref = rng.standard_normal((8, 8))
    test = ref.copy()
    test[6, 1] += 0.5  # bottom-left region, the worst element
    test[5, 2] += 0.01
    r = cg.numerics.compare(ref, test, atol=1e-3, rtol=0.0, region_grid=(2, 2))
    assert not r and r.worst_index == (6, 1)
    assert r.worst_test == pytest.approx(test[6, 1]) and r.worst_ref == pytest.approx(ref[6, 1])
    assert r.max_diff == pytest.approx(0.5)
    assert r.pct_over == pytest.approx(100 * 2 / 64)
    regions = {idx: bad for idx, _, bad in r.regions}
    assert regions[(1, 0)] == pytest.approx(100 * 2 / 16)
    assert regions[(0, 0)] == regions[(0, 1)] == regions[(1, 1)] == 0.0
    assert "FAIL" in str(r)


def test_compare_passes_within_tolerance(rng):
    ref = rng.standard_normal((5, 7))
    r = cg.numerics.compare(ref, ref + 1e-7, atol=1e-6, rtol=1e-6)
    assert r and r.pct_over == 0.0 and r.max_diff < 1e-6


def test_compare_nan_and_inf_always_fail(rng):
    ref = rng.standard_normal((4, 4))
    test = ref.copy()
    test[0, 0], test[1, 1], test[2, 2] = np.nan, np.inf, -np.inf
    r = cg.numerics.compare(ref, test, atol=1e9, rtol=1e9)
    assert not r and r.nan_count == 1 and r.inf_count == 2
    assert "1 NaN, 2 Inf" in str(r)


def test_compare_on_sharded_arrays(rng):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    ref = rng.standard_normal((16, 8))
    test = ref.copy()
    test[15, 7] += 1.0
    sharded = jax.device_put(test, NamedSharding(mesh, P("x", None)))
    r = cg.numerics.compare(ref, sharded, atol=1e-6, rtol=0)
    assert r.worst_index == (15, 7) and not r


def test_compare_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        cg.numerics.compare(np.ones((2, 2)), np.ones((2, 3)), atol=0, rtol=0)


def test_overlap_report_failures_and_spans_on_cpu():
    """A method that cannot run here (the fused kernel, on a CPU) is listed with its reason
    instead of stopping the report; device spans, asked for on a CPU, say why they are absent."""
    report = cg.bench.overlap_report(
        "ag",
        (1024, 64, 2048),
        methods={m: parse_method(m, "ag") for m in ("ring", "fused")},
        dtype="bfloat16",
        iters=3,
        spans=2,
        periods=1,
    )
    assert [r.name for r in report.rows] == ["xla", "ring"]
    assert all(len(r.result.samples) == 3 for r in report.rows)
    assert report.failures[0][0] == "fused" and "runs on GPUs" in report.failures[0][1]
    assert report.as_dict()["failures"] == [list(report.failures[0])]
    assert "no GPU activity" in report.span_error
    assert report.span_gemm_ms is None and all(r.span_ms is None for r in report.rows)
    assert "no GPU activity" in report.period_error and report.period_bound_ms is None
    assert all(r.period_ms is None and r.vs_bound_period is None for r in report.rows)
    with pytest.raises(ValueError, match="spans=-1"):
        cg.bench.overlap_report(
            "ag", (512, 128, 512), methods={m: parse_method(m) for m in ("none",)}, spans=-1
        )
    with pytest.raises(ValueError, match="periods=-1"):
        cg.bench.overlap_report(
            "ag", (512, 128, 512), methods={m: parse_method(m) for m in ("none",)}, periods=-1
        )


def test_overlap_report_figures():
    report = cg.bench.overlap_report(
        "rs",
        (256, 128, 64),
        methods={m: parse_method(m) for m in ("none", "ring:2")},
        dtype="float32",
        iters=3,
    )
    assert report.t_gemm_ms > 0 and report.t_comm_ms > 0
    # t_gemm: the faster of XLA's two GEMM forms (no Mosaic GPU or torch GEMM on a CPU)
    assert len(report.gemm_ms) == 2 and report.t_gemm_ms == min(report.gemm_ms.values())
    assert report.t_gemm_xla_ms == report.t_gemm_ms
    assert report.as_dict()["gemm_alone_ms"] == report.gemm_ms
    for row in report.rows:
        bound = max(report.t_gemm_ms, report.t_comm_ms)
        assert row.vs_bound == pytest.approx(row.t_ms / bound)
        assert row.hidden == pytest.approx(
            (report.t_gemm_ms + report.t_comm_ms - row.t_ms)
            / min(report.t_gemm_ms, report.t_comm_ms)
        )
    assert [r.name for r in report.rows] == ["xla", "none", "ring:2"]
    assert report.rows[2].max_error < 1e-3


@pytest.mark.parametrize("scaling", ["current_tensor_scaling", "mxfp8_1d_scaling"])
def test_overlap_report_with_scaling(scaling):
    """Quantized methods: the quantized local GEMM joins the bound's GEMMs, the methods agree
    with the quantized serial op, and the mode is recorded."""
    from commgemm.bench.overlap import QUANTIZED_GEMM

    report = cg.bench.overlap_report(
        "ag", (256, 64, 256), methods={m: parse_method(m) for m in ("none", "ring")},
        dtype="float32", iters=2, scaling=scaling,
    )  # fmt: skip
    assert QUANTIZED_GEMM in report.gemm_ms
    assert report.t_gemm_ms == min(report.gemm_ms.values())
    assert report.scaling == scaling.upper() and report.as_dict()["scaling"] == scaling.upper()
    assert report.rows[-1].max_error < 1e-5  # the ring against the quantized serial op


def test_overlap_report_refuses_stateful_scaling():
    with pytest.raises(ValueError, match="stateless"):
        cg.bench.overlap_report("ag", (256, 64, 64), scaling="delayed_tensor_scaling", iters=2)


def test_cli_bench_scaling(capsys):
    assert main(["bench", "--shape", "256,64,64", "--iters", "2", "--methods", "none",
                 "--scaling", "current_tensor_scaling"]) == 0  # fmt: skip
    assert "current_tensor_scaling on 8 x cpu" in " ".join(capsys.readouterr().out.split())


def test_best_gemm_bound_is_the_fastest_measured(monkeypatch):
    """A faster local GEMM (here a stand-in for torch's cuBLAS that multiplies a smaller block)
    becomes t_gemm and the bound; XLA's stays t_gemm_xla, with vs_bound_xla over it; one that
    cannot run is reported among the failures, not silently dropped."""
    from commgemm.bench.problems import Problem

    small = jax.jit(lambda a, b: a @ b)
    a, b = jnp.ones((8, 8), jnp.float32), jnp.ones((8, 8), jnp.float32)
    monkeypatch.setattr(Problem, "gemm_alone_torch", lambda self: (small, (a, b)))

    def broken(self):
        raise RuntimeError("no Hopper here")

    monkeypatch.setattr(Problem, "gemm_alone_mosaic", broken)
    report = cg.bench.overlap_report(
        "ag", (1024, 512, 1024), methods={"none": parse_method("none")}, dtype="float32", iters=5
    )
    xla = [report.gemm_ms[name] for name in ("gemm alone", "gemm alone (float32 result, cast)")]
    assert report.t_gemm_xla_ms == min(xla)
    assert report.gemm_ms["gemm alone (torch cuBLAS)"] < report.t_gemm_xla_ms
    assert (
        report.t_gemm_ms
        == min(report.gemm_ms.values())
        == report.gemm_ms["gemm alone (torch cuBLAS)"]
    )
    assert ("gemm alone (Mosaic GPU)", "RuntimeError: no Hopper here") in report.failures
    for row in report.rows:
        assert row.vs_bound == pytest.approx(row.t_ms / max(report.t_gemm_ms, report.t_comm_ms))
        assert row.vs_bound_xla == pytest.approx(
            row.t_ms / max(report.t_gemm_xla_ms, report.t_comm_ms)
        )


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gemm_alone_forms_compute_the_local_gemm(op):
    """Both forms of the bound's GEMM multiply each device's block: bf16 result against a
    float64 reference, within bf16's rounding (8 bits) of the largest |value|."""
    problem = cg.bench.make_problem(op, (512, 256, 512), "bfloat16")
    for cast in (False, True):
        fn, (a, b) = problem.gemm_alone(cast=cast)
        out = np.asarray(fn(a, b), np.float64)
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        ref = np.einsum("pik,pkj->pij", a64, b64)
        assert out.shape == ref.shape and out.shape[0] == problem.size
        np.testing.assert_allclose(out, ref, atol=2**-8 * np.abs(ref).max())


def test_record_prints_each_row_and_writes_all_with_the_device(tmp_path, capsys):
    """The benchmarks' results file: each row printed as one JSON line when added, the file
    holding every row so far under the device's kind, the jax version and the run's fields."""
    from commgemm.bench.record import record

    path, rows = tmp_path / "out.json", []
    record(path, rows, {"ms": 1.5}, m=8)
    record(path, rows, {"ms": 2.5}, m=8)
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [{"ms": 1.5}, {"ms": 2.5}]
    saved = json.loads(path.read_text())
    assert saved == {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "m": 8,
                     "rows": [{"ms": 1.5}, {"ms": 2.5}]}  # fmt: skip
    record(path, rows)  # no new row: rewritten, nothing printed
    assert capsys.readouterr().out == "" and json.loads(path.read_text())["rows"] == rows


def test_cli_knows_every_preset():
    from commgemm.cli import PRESET_NAMES

    assert sorted(PRESET_NAMES) == sorted(cg.bench.PRESETS)


def test_parse_method_and_shape():
    cfg = parse_method("ring-bidi:2")
    assert cfg.method is cg.Method.RING_EXCHANGE and cfg.bidirectional and cfg.num_splits == 2
    with pytest.raises(ValueError, match="unknown method 'warp'"):
        parse_method("warp")
    with pytest.raises(argparse.ArgumentTypeError, match="M,K,N"):
        args.shape("1,2")


def test_cli_bench_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(
        [
            "bench",
            "--op",
            "ag",
            "--shape",
            "256,64,64",
            "--dtype",
            "f32",
            "--iters",
            "3",
            "--methods",
            "none,ring,pipeline:2",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["environment"]["device_count"] == 8
    names = [r["name"] for r in data["report"]["rows"]]
    assert names == ["xla", "none", "ring", "pipeline:2"]
    assert all(len(r["timing"]["samples"]) == 3 for r in data["report"]["rows"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_says_why_a_method_did_not_run(capsys):
    code = main(
        ["bench", "--op", "ag", "--shape", "256,64,64", "--dtype", "f32", "--iters", "2",
         "--methods", "none,fused"]
    )  # fmt: skip
    assert code == 0
    assert re.search(r"fused: not\s+run:\s+ATOMIC_GEMM_AG_P2P", capsys.readouterr().out)


def test_cli_bench_fails_when_no_requested_method_ran(capsys):
    """Only fused, on a CPU: the backend is the reason given first, and the exit is 1."""
    code = main(["bench", "--shape", "256,64,64", "--dtype", "bf16", "--iters", "2",
                 "--methods", "fused"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 1 and "none of the methods fused ran" in out.err
    assert re.search(r"cannot run this call:\s+it runs on GPUs; this backend is cpu", out.out)


def test_cli_help_shows_each_default_once():
    """No option's help names its default twice, or a default of None."""
    from commgemm.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        assert isinstance(sub.formatter_class, type) and issubclass(
            sub.formatter_class, args.HelpFormatter
        ), name
        formatter = sub.formatter_class(name)
        for action in sub._actions:
            text = formatter._get_help_string(action) or ""
            text = text.replace("%(default)s", str(action.default))
            assert text.count("default") <= 1 and "(default: None)" not in text, (name, text)


def test_cli_tune_and_demo_progress_lines(capsys, tmp_path, monkeypatch):
    """Off a terminal, tune and demo print a line per step on stderr while they work."""
    monkeypatch.setenv("COMMGEMM_TUNE_CACHE", str(tmp_path / "tune.json"))
    assert main(["tune", "--shape", "256,64,64", "--dtype", "f32", "--iters", "2",
                 "--methods", "none,ring"]) == 0  # fmt: skip
    assert "tune ag: none (compile, check)" in capsys.readouterr().err
    assert main(["demo", "--size", "64", "--iters", "1"]) == 0
    err = capsys.readouterr().err
    assert "demo: ag NONE" in err and "demo: rs" in err


def test_cli_info(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["device_count"] == 8 and "jax" in info


def test_cli_bench_progress_lines_and_cpu_note(capsys):
    """Off a terminal, a line per step on stderr; on a CPU, the note that timings are only a
    smoke test."""
    code = main(["bench", "--shape", "256,64,64", "--iters", "2", "--methods", "none,ring"])
    assert code == 0
    out = capsys.readouterr()
    assert "bench ag: none (compile, check)" in out.err and "bench ag: ring" in out.err
    assert "only a smoke test" in out.out


def test_cli_version_and_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and f"commgemm {cg.__version__}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "(default: 50)" in text and "GPU-sized" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["demo", "--iters", "0"], "--iters: 0 must be >= 1"),
        (["demo", "--processes", "0"], "--processes: 0 must be >= 1"),
        (["demo", "--dtype", "int8"], "--dtype: 'int8': choose from"),
        (["bench", "--iters", "1"], "--iters: 1 must be >= 2"),
        (["bench", "--shape", "10,10"], "must be M,K,N"),
        (["bench", "--shape", "0,10,10"], "must be M,K,N"),
        (["bench", "--methods", "foo"], "unknown method 'foo'"),
        (["bench", "--methods", "ring:0"], "num_splits=0"),
        (["bench", "--methods", "ring:x"], "number of splits"),
        (["tune", "--shape", "8,8,8", "--periods", "-1"], "--periods: -1 must be >= 0"),
        (["launch", "-n", "0", "--", "true"], "-n: 0 must be >= 1"),
        (["launch", "-n", "1", "--timeout", "0", "--", "true"], "--timeout: 0.0 must be > 0"),
        (["launch", "-n", "1", "--cpu-devices", "0", "--", "true"], "--cpu-devices: 0"),
    ],
)
def test_cli_refuses_bad_flags_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and "Traceback" not in err


def test_cli_demo_size_must_divide(capsys):
    assert main(["demo", "--size", "10"]) == 2
    assert "--size 10 must be a multiple of 32" in capsys.readouterr().err


def test_one_spelling_of_methods_and_dtypes():
    """The CLI's short names work in the library too."""
    assert parse_method("ring").method is cg.OverlapConfig(method="ring").method
    assert args.dtype("bf16") == args.dtype("bfloat16") == "bfloat16"
    assert cg.OverlapConfig(out_dtype="bf16").out_dtype == "bfloat16"


def test_capabilities_script_runs(tmp_path):
    """benchmarks/capabilities.py (the multi-GPU run's script) end to end on 8 virtual CPU
    devices with tiny shapes: every section but the layers' (the training example's own test
    covers that model) and the float8 fused backward's, rows for every variant."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).parent.parent
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "capabilities.py"), "--out", str(tmp_path),
         "--quick", "--sections",
         "fp8,grouped,grouped_fp8,grouped_fp8_weights,backward,fused_backward"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "capabilities.json").read_text())
    assert len(result["devices"]) == 8
    fp8 = result["fp8"][0]
    assert set(fp8["ms"]) == {"xla bf16", "bf16 none", "bf16 auto", "fp8 none", "fp8 ring",
                              "fp8 auto", "timing"}  # fmt: skip
    assert fp8["ms"]["timing"] == "host medians of 3"
    assert all(0 < e < 0.1 for e in fp8["rel_error_vs_bf16"].values())
    assert [r["method"] for r in result["grouped"]] == [
        "none",
        "pipeline:4",
        "ring",
        "expert parallel",
        "none: regrouped or block by block",
    ]
    assert set(result["grouped"][-1]["ms"]) == {
        "ag+grouped none, regrouped", "ag+grouped none, block by block", "timing"
    }  # fmt: skip
    assert all(t > 0 for row in result["backward"] for n, t in row["ms"].items() if n != "timing")
    assert [r["op"] for r in result["grouped_fp8"]] == [
        "ag+grouped ring", "ag+grouped none", "all-to-all+grouped ring", "grouped+rs none",
    ]  # fmt: skip
    for row in result["grouped_fp8"]:  # on CPUs the float8 blocks are emulated either way
        errors = row["rel_error_vs_bf16"]
        assert len(row["ms"]) == 8 and errors["kernel vs emulated"] == 0
        assert errors["gradients, kernel vs emulated"] == [0, 0]
    assert [r["op"] for r in result["grouped_fp8_weights"]] == [
        "grouped (local, one device)", "ag+grouped ring", "ag+grouped none",
        "all-to-all+grouped ring", "grouped+rs none", "all-to-all+grouped none",
    ]  # fmt: skip
    for row in result["grouped_fp8_weights"]:  # the same quantized values, kept or not
        assert set(row["ms"]) == {"bf16", "fp8 quantizing w", "fp8 quantized before",
                                  "fp8 quantized before, kept transposed", "timing"}  # fmt: skip
        assert row["errors"] == {"kept vs not, max abs": 0.0}
    for row in result["fused_backward"]:  # the fused kernels do not run on CPUs
        assert set(row["ms"]) == {"xla", "split ring", "timing"}
        assert row["mosaic_kernels"] == {"xla": 0, "split ring": 0}


def test_layers_profile_breakdown_and_smoke_run(tmp_path):
    """The kernel-kind breakdown of a synthetic trace (`bench.kernels`, which
    benchmarks/layers_profile.py and the step benchmarks' --profile use: exposed collective time
    is what no other kernel covers), and a layers_profile smoke run on 8 CPU devices where every
    variant's first loss is the same model's."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).parent.parent
    from commgemm.bench import kernels

    ms = 1e6  # ns
    events = [  # two steps: a GEMM 0-4 ms, an all-gather 3-6 ms (1 ms under the GEMM), other 6-7,
        # a permute 7-9 alone, a fused Mosaic kernel 9-10 (a GEMM), a scatter-add 10-12
        (0.0, 4 * ms, "nvjet_sm90_gemm"),
        (3 * ms, 6 * ms, "ncclDevKernel_AllGather_RING_LL"),
        (6 * ms, 7 * ms, "loop_fusion"),
        (7 * ms, 9 * ms, "ncclDevKernel_SendRecv"),
        (9 * ms, 10 * ms, "body_mosaic_gpu_kernel"),
        (10 * ms, 12 * ms, "input_scatter_fusion"),
    ]
    found = kernels.breakdown(events, steps=2)
    assert found["ms_by_kind"] == {"gemm": 2.5, "collective": 2.5, "other": 0.5, "scatter": 1.0}
    assert found["collective_exposed_ms"] == 2.0  # (2 + 2) ms over 2 steps
    assert list(found["top_kernels_ms"])[0] == "nvjet_sm90_gemm"
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "layers_profile.py"), "--out", str(tmp_path),
         "--quick", "--dtypes", "float32", "--methods", "xla,none,auto"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((tmp_path / "layers_profile.json").read_text())["rows"][0]
    losses = row["ms"]  # on CPU: each variant's loss after its first step
    assert set(losses) == {"xla", "none", "auto"}
    np.testing.assert_allclose(list(losses.values()), losses["xla"], rtol=1e-5)


def test_step_script_runs(tmp_path):
    """benchmarks/step.py (the layer step's benchmark) on 8 virtual CPU devices with tiny
    shapes: the commgemm layer's first loss equals XLA's partitioning of the same layer, in bf16
    and FP8, also with methods named per op (ring/none); no device timing on a CPU, so no ratio
    is claimed."""
    rows = _step_script(tmp_path, "auto,none,ring/none,auto-fast-dgrad,xla,comm")
    for row in rows:  # the fast-dgrad recipe's AUTO in the FP8 row only
        fp8 = {"auto-fast-dgrad": True} if row["dtype"] == "fp8" else {}
        assert row["loss_ok"] == {"auto": True, "none": True, "ring/none": True, "xla": True,
                                  **fp8}  # fmt: skip
        assert row["ms"] == {} and row["ratios"] == {}


@pytest.mark.parametrize("devices", [1, 4])
def test_step_script_flax_variants(tmp_path, devices):
    """step.py's nnx (commgemm's Flax layers, AUTO) and flax (plain Flax modules) variants
    hold step.py's weights: their first losses match XLA's partitioning of the same layer
    (flax only at P = 1: elsewhere it is one device's share, as `local`); bf16 (flax takes
    only bf16; the nnx layers' FP8 is tests/test_nnx.py's)."""
    flags = cpu_env(devices)["XLA_FLAGS"]
    (row,) = _step_script(tmp_path, "xla,nnx,flax", ("bf16",), XLA_FLAGS=flags)
    flax = {"flax": True} if devices == 1 else {}
    assert row["devices"] == devices
    assert row["loss_ok"] == {"xla": True, "nnx": True, **flax}, row["loss"]
    assert "flax" in row["loss"]


def _step_script(tmp_path, variants: str, dtypes=("bf16", "fp8"), **env) -> list[dict]:
    """step.py --quick --sizes 8b --variants `variants` --dtypes `dtypes` on the CPU (8 virtual
    devices unless `env` sets XLA_FLAGS): its rows, one per dtype in order."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).parent.parent
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)} | env
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "step.py"), "--out", str(tmp_path), "--quick",
         "--sizes", "8b", "--variants", variants, "--dtypes", ",".join(dtypes)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "step.json").read_text())
    assert "nccl" in result  # the NCCL the run called (None where none was loaded)
    rows = result["rows"]
    assert [r["dtype"] for r in rows] == list(dtypes)
    return rows


def _step_module():
    """benchmarks/step.py as a module."""
    return load_script("benchmarks/step.py", "step_benchmark")


def test_step_table_in_both_launch_modes(tmp_path, rng):
    """`launch_modes.py --table DIR` prints the layer step's rows of both launch modes side by
    side (DIR/one_process, DIR/per_gpu: `run.sh step-modes`): each cell the ratio step.py
    worked out for its mode (step / that run's t_bound, XLA's time over AUTO's), "host-bound"
    where a step was, "-" where a mode did not run the row."""
    step = _step_module()
    modes = load_script("benchmarks/launch_modes.py", "launch_modes_benchmark")
    made = {}
    for mode, names in (("one_process", ("auto", "none", "xla")), ("per_gpu", ("auto", "xla"))):
        rows = []
        for size, dtype in (("8b", "bf16"), ("8b", "fp8"), ("13b", "bf16")):
            if mode == "per_gpu" and size == "13b":
                continue  # a row one mode did not run
            ms = {n: float(rng.uniform(10, 12)) for n in (*names, "local", "comm")}
            ms["comm"] = float(rng.uniform(1, 3))
            busy = {n: 0.99 for n in ms} | ({"none": 0.5} if dtype == "fp8" else {})
            row = {"size": size, "dtype": dtype, "ms": ms, "busy": busy}
            row["ratios"] = step.ratios(row)
            rows.append(row)
        made[mode] = {(r["size"], r["dtype"]): r for r in rows}
        (tmp_path / mode).mkdir()
        (tmp_path / mode / "step.json").write_text(json.dumps({"devices": 4, "rows": rows}))
    lines = modes.step_table(tmp_path).splitlines()
    assert len(lines) == 2 + 3
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        key = (cells[1], cells[2])
        one, many = made["one_process"][key], made["per_gpu"].get(key)
        assert cells[0] == "4" and cells[3] == f"{one['ratios']['t_bound_ms']:.2f}"
        for i, name in zip((4, 5, 6), ("auto", "none", "xla"), strict=True):
            want = one["ratios"][name]
            assert cells[i] == (want if want == "host-bound" else f"{want['vs_bound']:.3f}")
        assert cells[7] == f"{one['ratios']['auto']['speedup_vs_xla']:.3f}"
        if many is None:
            assert cells[8:] == ["-"] * 3
        else:
            assert cells[8] == f"{many['ratios']['auto']['vs_bound']:.3f}"
            assert cells[9] == f"{many['ratios']['xla']['vs_bound']:.3f}"
            assert cells[10] == f"{many['ratios']['auto']['speedup_vs_xla']:.3f}"
            assert abs(float(cells[8]) - many["ms"]["auto"] / many["ratios"]["t_bound_ms"]) < 6e-4


def test_step_variant_with_an_unknown_suffix_is_refused():
    """A variant NAME+SUFFIX names compiler options step.py knows (+lhs); another suffix is
    refused before anything is built."""
    step = _step_module()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    with pytest.raises(ValueError, match=r"unknown suffix \+fast .*\+lhs"):
        step.variants(step.QUICK, mesh, jnp.bfloat16, None, ["auto", "xla+fast"])


@pytest.mark.parametrize("dtypes", ["fp9", "bf16,fp8-fast", "fp8,"])
def test_step_scripts_refuse_an_unknown_dtype(dtypes, monkeypatch, capsys):
    """The step scripts' --dtypes (step.py's and moe_step.py's command line) takes bf16 and fp8
    only: another name is refused with the known ones, not run as bf16."""
    step = _step_module()
    monkeypatch.setattr("sys.argv", ["step.py", "--out", "o", "--dtypes", dtypes])
    with pytest.raises(SystemExit) as raised:
        step.arguments(step.__doc__, "8b", "auto")
    assert raised.value.code == 2 and "not among bf16, fp8" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["step.py", "--out", "o", "--dtypes", "fp8,bf16"])
    assert step.arguments(step.__doc__, "8b", "auto").dtypes == "fp8,bf16"


def test_step_benchmarks_run_only_the_steps_that_compile_and_fit(monkeypatch):
    """The step benchmarks' first steps: a variant that does not compile, or whose compiled
    buffers exceed the device's free memory (one GPU out of memory left the other waiting in
    NCCL), is reported and left out before anything runs; the others give their loss."""
    step = _step_module()

    def loss_step(scale):
        return jax.jit(lambda a: (a, a, jnp.sum(a * a) * scale)), (jnp.ones((64, 64)),)

    found = {
        "small": loss_step(1.0),
        "broken": (jax.jit(lambda a: (a, a, a @ jnp.ones((3, 3)))), (jnp.ones((64, 64)),)),
        "comm": loss_step(3.0),
    }
    row = {"loss": {}}
    device = jax.local_devices()[0]
    monkeypatch.setattr(type(device), "memory_stats", lambda self: None, raising=False)
    step.first_losses(found, row, skip=("comm",))
    assert row["loss"] == {"small": 64 * 64} and set(found) == {"small", "comm"}
    assert "TypeError" in row["errors"]["broken"]  # incompatible shapes for dot

    class FailsWhenRun:  # compiles, then fails at its first step (as a refused collective)
        def __init__(self, fn):
            self.lower = fn.lower

        def __call__(self, *args):
            raise RuntimeError("refused at run time")

    found = {"small": loss_step(1.0), "fails": (FailsWhenRun(loss_step(2.0)[0]), found["small"][1])}
    row = {"loss": {}}
    step.first_losses(found, row)
    assert row["loss"] == {"small": 64 * 64} and set(found) == {"small"}
    assert row["errors"] == {"fails": "RuntimeError: refused at run time"}

    # 1 MiB free on the last device, 1 GiB on the others: the step on 64 x 64 (about 100 KiB of
    # buffers) fits, on 1024 x 1024 not (the device with the least free memory decides)
    last = jax.local_devices()[-1].id

    def stats(self):
        return {"bytes_limit": 2**30 + (2**20 if self.id == last else 2**30), "bytes_in_use": 2**30}

    monkeypatch.setattr(type(device), "memory_stats", stats, raising=False)
    found = {"small": loss_step(1.0), "big": (found["small"][0], (jnp.ones((1024, 1024)),))}
    row = {"loss": {}}
    step.first_losses(found, row)
    assert set(row["loss"]) == {"small"} and set(found) == {"small"}
    want = rf"needs [\d.]+ GiB a device, 0\.0 GiB free on device {last}"
    assert re.fullmatch(want, row["errors"]["big"])


def test_step_ratios_leave_host_bound_steps_out():
    """benchmarks/step.py's figures: step / t_bound with t_bound = max(t_local, t_comm), the
    speedup over XLA only where XLA's step is device-bound too, no ratio for a host-bound
    step; exposed collective time (`bench.kernels.exposed_ms`, the steps' column) is the
    collectives' time no other kernel ran beside."""
    from commgemm.bench import kernels

    step = _step_module()
    row = {
        "ms": {"auto": 11.0, "none": 12.0, "xla": 13.0, "comm": 4.0, "local": 10.0},
        "busy": {"auto": 0.95, "none": 0.5, "xla": 0.97, "comm": 0.99, "local": 0.99},
    }
    found = step.ratios(row)
    assert found["t_bound_ms"] == 10.0 and found["none"] == "host-bound"
    assert found["auto"] == {"vs_bound": 1.1, "speedup_vs_xla": round(13 / 11, 3)}
    row["busy"]["xla"] = 0.8
    assert step.ratios(row)["auto"]["speedup_vs_xla"] is None
    events = [(0, 100, "gemm"), (50, 250, "ncclDevKernel_AllGather"), (300, 400, "gemm")]
    assert kernels.exposed_ms(events, steps=2) == 150 / 2 / 1e6  # 100..250 uncovered


def test_grouped_roofline_helpers():
    """benchmarks/grouped_gemm.py's roofline: Zipf group sizes sum to the tokens (some groups
    may be empty), the least bytes count only experts that receive rows, and t_roof is the
    larger of the compute and the memory time."""
    bench = load_script("benchmarks/grouped_gemm.py", "grouped_gemm_benchmark")
    for groups in (8, 64, 128):
        sizes = bench.zipf_sizes(groups, 8192, seed=groups)
        assert sizes.sum() == 8192 and len(sizes) == groups and (sizes >= 0).all()
        assert sizes.max() > 8192 / groups  # skewed
        uneven = bench.uneven_sizes(groups, 8192, seed=groups)
        assert uneven.sum() == 8192 and (uneven > 0).all()
    sizes = np.array([5, 0, 3, 0])
    assert bench.least_bytes(sizes, 8, 4, 6, 2) == 2 * (8 * 4 + 2 * 4 * 6 + 8 * 6)
    # float8 operands, a bf16 output
    assert bench.least_bytes(sizes, 8, 4, 6, 1, out_itemsize=2) == 8 * 4 + 2 * 4 * 6 + 2 * 8 * 6
    # dW: x and dY read, the two receiving experts' dW written
    dw = bench.least_bytes(sizes, 8, 4, 6, 1, dw=True, out_itemsize=2)
    assert dw == 8 * 4 + 8 * 6 + 2 * 2 * 4 * 6
    assert bench.roofline_ms(2e12, 1e9, 1e15, 2e12) == 2.0  # compute: 2 ms, memory: 0.5 ms
    assert bench.roofline_ms(2e12, 8e9, 1e15, 2e12) == 4.0  # memory-bound


def test_grouped_benchmark_rows_quick(tmp_path, monkeypatch):
    """benchmarks/grouped_gemm.py's main() with --quick (kernels and timing stubbed: the GPU
    kernels do not run on the CPU): the problem builders get the quick forms, only QUICK's
    variants and the roofline's references are timed, and each row's FP8 dX and dW ratios
    read against their own rooflines, t = t_roof where a variant is its own reference."""
    bench = load_script("benchmarks/grouped_gemm.py", "grouped_gemm_benchmark")
    extra = ["lax.ragged_dot", "jax kernel", "fp8 emulated (quantizing)"]
    dw_names = ["dW commgemm (ping-pong)", "dW fp8, dequantized + 16-bit kernel",
                "dense x^T dy, same FLOPs", "fp8 dense x^T dy, same FLOPs"]  # fmt: skip
    calls = []

    def problem(groups, m, k, n, skew, kernels=None):
        calls.append(("fwd", list(kernels)))
        sizes = jnp.asarray(bench.SIZES[skew](groups, m, groups))
        return {name: (None, ()) for name in [*bench.QUICK, *extra]}, {}, sizes

    def weight_grad_problem(groups, m, k, n, skew, quick=False):
        calls.append(("dw", quick))
        return {name: (None, ()) for name in dw_names}, {}

    def timed(variants):  # the FP8 dX and dense FP8 GEMM alike: dX's ratio is its roofline's
        ms = {"fp8 dX, fast": 0.5, "fp8 dense GEMM, same FLOPs": 0.5}
        return {name: ms.get(name, 1.0) for name in variants}, "stub"

    monkeypatch.setattr(bench, "problem", problem)
    monkeypatch.setattr(bench, "weight_grad_problem", weight_grad_problem)
    monkeypatch.setattr(bench, "timed", timed)
    monkeypatch.setattr(bench.mosaic_tiles, "num_sms", lambda: 132)
    argv = ["grouped_gemm.py", "--out", str(tmp_path), "--groups", "8", "--skews", "equal"]
    monkeypatch.setattr("sys.argv", [*argv, "--quick"])
    bench.main()
    assert calls == [("fwd", ["commgemm ping-pong kernel"]), ("dw", True)]
    (row,) = json.loads((tmp_path / "grouped_gemm.json").read_text())["rows"]
    assert set(row["ms"]) == {*bench.QUICK, "hbm copy"} and row["vs_ragged_dot"] is None
    # the FP8 dX's bytes: dY [M, N] and w (1 byte), dX [M, K] (2 bytes); compute-bound here
    assert row["fp8_dx_t_roof_ms"] == pytest.approx(0.5)
    assert row["fp8_vs_roof"]["fp8 dX, fast"] == pytest.approx(1.0)
    assert row["dw"]["fp8_vs_roof"]["fp8 dense x^T dy, same FLOPs"] == pytest.approx(1.0)


def test_grouped_pingpong_waves():
    """benchmarks/grouped_gemm.py's wave count: equal groups of whole tiles run a dense GEMM's
    tiles; a group's partial last tile (and its first, from the row below its start rounded to
    8) adds tiles; the waves are the most tiles any CTA runs."""
    bench = load_script("benchmarks/grouped_gemm.py", "grouped_gemm_benchmark")
    equal = bench.equal_sizes(8, 8192, seed=0)
    assert equal.tolist() == [1024] * 8 and bench.equal_sizes(3, 10, 0).tolist() == [4, 3, 3]
    got = bench.pingpong_waves(equal, 8192, 1792, sms=132)
    assert got == {"tiles": 64 * 14, "waves": 7, "dense_tiles": 64 * 14, "dense_waves": 7}
    # rows [0, 100) and [100, 128): the second group's tile starts at row 96, so 2 row tiles
    two = bench.pingpong_waves(np.array([100, 0, 28]), 128, 256, sms=3)
    assert two == {"tiles": 4, "waves": 2, "dense_tiles": 2, "dense_waves": 1}
    uneven = bench.pingpong_waves(bench.uneven_sizes(8, 8192, seed=8), 8192, 1792, sms=132)
    assert uneven["tiles"] > uneven["dense_tiles"] and uneven["waves"] >= 7
