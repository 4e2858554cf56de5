"""benchmarks/moe_step.py: its XLA-ops baseline (ragged all-to-all + ragged dots) computes the
same block as commgemm's, values and gradients, and the script runs end to end."""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_script
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg
from commgemm.nnx import moe_per_shard

ROOT = pathlib.Path(__file__).parent.parent


@functools.cache
def _bench():
    return load_script("benchmarks/moe_step.py", "moe_step_benchmark")


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_emulated_ragged_all_to_all(devices):
    """Each device's chunk j (rows offset + [0, size)) lands in device j's output at the
    offset it names, every other output row kept: the semantics of lax.ragged_all_to_all."""
    rng = np.random.default_rng(devices)
    rows, width = 12, 3
    send = rng.integers(0, rows // devices + 1, (devices, devices))  # [src, dst]
    in_off = np.cumsum(send, 1) - send
    out_off = np.cumsum(send, 0) - send  # each destination's chunks by source
    operand = rng.standard_normal((devices, rows, width))
    output = rng.standard_normal((devices, rows, width))
    want = output.copy()
    for s in range(devices):
        for d in range(devices):
            n = send[s, d]
            want[d, out_off[s, d] : out_off[s, d] + n] = operand[s, in_off[s, d] : in_off[s, d] + n]
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    fn = jax.shard_map(
        lambda o, out, io, ss, oo: _bench().emulated_ragged_all_to_all(
            o[0], out[0], io[0], ss[0], oo[0], None, axis_name="x"
        )[None],
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
    got = fn(operand, output, in_off, send, out_off)  # row s: source s's chunks
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("devices,experts,top_k", [(2, 4, 2), (4, 8, 2), (8, 8, 3)])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dot", ["ragged_dot", "grouped_matmul"])
def test_xla_baseline_matches_commgemm_block(devices, experts, top_k, check_vma, dot):
    """The ragged all-to-all block's loss and gradients (router, both experts' weights), with
    XLA's ragged dots (the xla variant) or commgemm's grouped GEMMs (ragged-a2a), equal
    commgemm's serial block's in float32 (rtol 1e-5) on fresh random tokens and weights."""
    rng = np.random.default_rng(devices * 10 + top_k)
    m, h, f = 16 * devices, 16, 24
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
    params = {
        "router": jnp.asarray(rng.standard_normal((h, experts)), jnp.float32),
        "w1": jnp.asarray(rng.standard_normal((experts, h, f)) / h**0.5, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((experts, f, h)) / f**0.5, jnp.float32),
    }
    mesh = Mesh(np.array(jax.devices()[:devices]), ("tp",))
    specs = {"router": P(), "w1": P("tp"), "w2": P("tp")}
    blocks = {
        "xla": functools.partial(
            _bench().xla_moe_per_shard,
            k=top_k,
            axis_name="tp",
            dot={"ragged_dot": jax.lax.ragged_dot, "grouped_matmul": cg.grouped_matmul}[dot],
        ),
        "commgemm": functools.partial(
            moe_per_shard,
            k=top_k,
            axis_name="tp",
            config=cg.OverlapConfig(method="none"),
            scaling=None,
        ),
    }
    results = {}
    for name, block in blocks.items():
        forward = jax.shard_map(
            lambda p, a, block=block: block(a, p["router"], p["w1"], p["w2"]),
            mesh=mesh,
            in_specs=(specs, P("tp", None)),
            out_specs=P("tp", None),
            check_vma=check_vma,
        )
        loss = lambda p, forward=forward: jnp.sum(jnp.sin(forward(p, x)))  # noqa: E731
        results[name] = jax.jit(jax.value_and_grad(loss))(params)
    (lx, gx), (lc, gc) = results["xla"], results["commgemm"]
    np.testing.assert_allclose(lx, lc, rtol=1e-5)
    for key in params:
        scale = float(jnp.abs(gc[key]).max())
        np.testing.assert_allclose(gx[key], gc[key], rtol=1e-5, atol=1e-6 * scale)


def test_moe_step_script_runs(tmp_path):
    """The script on 8 virtual CPU devices with tiny shapes, gradients accumulated over 2
    micro-batches a step:
    commgemm's AUTO and serial blocks' and the ragged all-to-all block's first losses equal the
    XLA-ops block's (bf16), and FP8's are within 10%, with fast accumulation everywhere
    (auto-fast: FP8 rows only) too; a capacity-capped variant (none@0.5) runs, its loss finite
    and unchecked; no device timing on a CPU, so no ratio is claimed.
    (One batch a step: test_multiprocess's run of the script.)"""
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "moe_step.py"),
            "--out",
            str(tmp_path),
            "--quick",
            "--sizes",
            "fine",
            "--variants",
            "auto,none,none@0.5,xla,ragged-a2a,auto-fast",
            "--microbatches",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "moe_step.json").read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["bf16", "fp8"]
    assert all(r["microbatches"] == 2 for r in rows)
    ours = {"auto": True, "none": True}
    assert rows[0]["loss_ok"] == {**ours, "xla": True, "ragged-a2a": True}
    assert rows[1]["loss_ok"] == {**ours, "auto-fast": True}
    assert all(r["ms"] == {} and r["ratios"] == {} for r in rows)
    assert all(np.isfinite(r["loss"]["none@0.5"]) for r in rows)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16])
def test_accumulated_gradients_equal_the_whole_batch(rng, dtype):
    """`accumulated` over N micro-batches: the mean of their losses and the gradients of that
    mean, as value_and_grad of the mean over the stacked batches (float64: 1e-12; bf16
    parameters: their dtype kept, within bf16's rounding of the float64 gradients)."""
    n, b, d = 3, 5, 4
    batches = jnp.asarray(rng.standard_normal((n, b, d)))
    params = {"w": jnp.asarray(rng.standard_normal((d, d)), dtype), "s": jnp.asarray(0.5, dtype)}

    def loss(p, x):
        return jnp.mean(jnp.tanh(x.astype(p["w"].dtype) @ p["w"]).astype(jnp.float64) ** 2) * p["s"]

    got_loss, got = jax.jit(_bench().accumulated(loss))(params, batches)
    exact = {k: v.astype(jnp.float64) for k, v in params.items()}
    whole = lambda p: jnp.mean(jax.vmap(lambda x: loss(p, x))(batches))  # noqa: E731
    want_loss, want = jax.value_and_grad(whole)(exact)
    tol = 1e-12 if dtype == jnp.float64 else 2e-2
    np.testing.assert_allclose(got_loss, want_loss, rtol=tol)
    for key in params:
        assert got[key].dtype == dtype
        np.testing.assert_allclose(np.asarray(got[key], np.float64), want[key], rtol=tol, atol=tol)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_experts_quantized_once_step_as_quantized_each_call(microbatches):
    """An FP8 variant with its experts quantized once a step (`auto+qw`: `cg.quantize_weight`
    outside the accumulation, the gradients pulled back to the weights) takes the same step
    as quantizing them in every call: the same loss and updated parameters (float32 params,
    to a float32 rounding); bf16 has no such variant."""
    bench = _bench()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    names = ["auto", "auto" + bench.QW]
    steps = bench.variants(bench.QUICK, mesh, jnp.float32, bench.FP8, names, microbatches)
    assert list(steps) == names
    (p1, _, l1), (p2, _, l2) = (jax.jit(f)(*a) for f, a in steps.values())
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for key in p1:
        np.testing.assert_allclose(p1[key], p2[key], rtol=1e-5, atol=1e-7)
    assert list(bench.variants(bench.QUICK, mesh, jnp.float32, None, names, 1)) == ["auto"]


@pytest.mark.parametrize("name", ["xla+qw", "ragged-a2a+qw"])
def test_quantized_once_refused_for_the_bf16_blocks(name):
    """+qw on a block that runs in bf16 alone (xla, ragged-a2a) is refused by name, in any dtype
    row, rather than failing inside the block or being dropped."""
    bench = _bench()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    for scaling in (None, bench.FP8):
        with pytest.raises(ValueError, match=re.escape(name) + ": the .* block runs in bf16"):
            bench.variants(bench.QUICK, mesh, jnp.bfloat16, scaling, ["auto", name])


@pytest.mark.parametrize("microbatches", [0, -2])
def test_microbatches_must_be_positive(microbatches):
    """--microbatches below 1 is refused with its value, before any step is built."""
    bench = _bench()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    with pytest.raises(ValueError, match=f"microbatches={microbatches} must be 1 or more"):
        bench.variants(bench.QUICK, mesh, jnp.bfloat16, None, ["none"], microbatches)


@pytest.mark.parametrize("processes, backend", [(1, "gpu"), (2, "gpu"), (2, "cpu")])
def test_ragged_variants_left_out_across_gpu_processes(processes, backend):
    """With several processes on GPUs the variants on XLA's ragged all-to-all (xla,
    ragged-a2a) are dropped before any runs, each with its reason in the row's errors; one
    process, or the CPU (where an all-to-all stands in for it), keeps every variant."""
    bench = _bench()
    names = ["auto", "xla", bench.RAGGED, "none"]
    found, row = {name: (None, ()) for name in names}, {}
    bench.leave_out_ragged(found, row, processes, backend)
    dropped = processes > 1 and backend == "gpu"
    assert sorted(found) == sorted(["auto", "none"] if dropped else names)
    assert row.get("errors", {}) == (
        {"xla": bench.RAGGED_ACROSS_PROCESSES, bench.RAGGED: bench.RAGGED_ACROSS_PROCESSES}
        if dropped
        else {}
    )


def test_input_grad_step():
    """With input_grad the step also returns the block input's gradient: the same loss and
    updated parameters as without, and dX matching a central difference of the loss along a
    random direction (float32; a fixed one, as the benchmark's data is: a longer step can
    change a token's experts); refused with micro-batches."""
    bench = _bench()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    ((f, args),) = bench.variants(bench.QUICK, mesh, jnp.float32, None, ["auto"]).values()
    ((g, _),) = bench.variants(bench.QUICK, mesh, jnp.float32, None, ["auto"], 1, True).values()
    p1, _, l1 = jax.jit(f)(*args)
    p2, _, l2, dx = jax.jit(g)(*args)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for key in p1:
        np.testing.assert_allclose(p1[key], p2[key], rtol=1e-6, atol=1e-8)
    params, state, x = args
    v = jnp.asarray(np.random.default_rng(0).standard_normal(x.shape), jnp.float32)
    eps = 1e-3
    loss = lambda a: float(jax.jit(f)(params, state, a)[2])  # noqa: E731
    slope = (loss(x + eps * v) - loss(x - eps * v)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.vdot(dx, v)), slope, rtol=1e-2)
    with pytest.raises(ValueError, match="input_grad takes one batch"):
        bench.variants(bench.QUICK, mesh, jnp.float32, None, ["auto"], 2, True)
