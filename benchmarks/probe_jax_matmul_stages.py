"""Probe (one H200): does jax's Hopper matmul kernel (`hopper_matmul_mgpu.kernel`) compute
every tile right when its K-steps are not whole rounds of stages (the last K-step's smem slot is
then not the last one reloaded by the next tile), on calls that alternate x and -x? Our ring RS
kernel runs it per step with delay_release=0 (each wgmma awaited); jax's ring AG kernel
(`all_gather_lhs_matmul`, our RING_EXCHANGE fused AG) runs it with delay_release=1 (one wgmma in
flight), the setting whose race our own kernels had (`tiles.await_last_step`). The kernel is
called directly in both settings; our ring RS on a one-device mesh is tried too (it needs
NVSHMEM peers).
    PYTHONPATH=. python3 benchmarks/probe_jax_matmul_stages.py --out DIR [--delay 0,1]"""

import argparse
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import commgemm as cg
from commgemm.mosaic_gpu import fused
from commgemm.mosaic_gpu import tiles as mt
from commgemm.mosaic_gpu.configs import RingRSConfig

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=pathlib.Path, required=True)
parser.add_argument("--delay", default="0,1", help="delay_release values of jax's kernel")
args = parser.parse_args()


def jax_kernel(config, delay: int, m: int, n: int):
    """jax's Hopper matmul kernel alone, with `delay` (delay_release), as jitted fn(a, b)."""
    config = dataclasses.replace(config, epi_tile_m=64, epi_tile_n=64)
    body = functools.partial(hm.kernel, config=config, delay_release=delay)
    call = plgpu.kernel(
        lambda a, b, out: body(a, b, None, out),
        out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        **mt.kernel_params(mt.num_sms(), 1),
    )
    return jax.jit(call)


args.out.mkdir(parents=True, exist_ok=True)
rows = []
for k in (640, 1024, 1152):  # 10, 16, 18 K-steps of 64
    m, n = 8192, 7168
    kx, kw = jax.random.split(jax.random.key(k))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    for stages in (3, 4):
        config = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=stages,
                                 grid_tile_width=8)  # fmt: skip
        kernels = {f"jax kernel, delay_release={d}": jax_kernel(config, int(d), m, n)
                   for d in args.delay.split(",")}  # fmt: skip
        cfg = cg.OverlapConfig(method="ring_exchange", atomic_gemm=True,
                               kernel=RingRSConfig(stages=stages))  # fmt: skip
        mesh = Mesh(jax.devices()[:1], ("x",))
        body = lambda a, b, c=cfg: fused.matmul_reduce_scatter(  # noqa: E731
            a, b, "x", c, w_transposed=False
        )
        specs = dict(in_specs=(P(None, "x"), P("x")), out_specs=P("x"), check_vma=False)
        ring = jax.jit(jax.shard_map(body, mesh=mesh, **specs))
        for name, fn in (*kernels.items(), ("ring RS, one device", ring)):
            errs = []
            try:
                for sign in (-1, 1, -1, 1):
                    ref = jnp.dot((sign * x).astype(jnp.float32), w.astype(jnp.float32))
                    got = fn(sign * x, w).astype(jnp.float32)
                    errs.append(float(jnp.abs(got - ref).max() / jnp.abs(ref).max()))
            except Exception as e:  # noqa: BLE001 - recorded
                errs.append(f"error: {str(e)[:200]}")
            row = dict(kernel=name, k=k, k_steps=k // 64, stages=stages, rel_errors=errs)
            rows.append(row)
            print(json.dumps(row), flush=True)
(args.out / "probe_jax_matmul_stages.json").write_text(json.dumps(rows, indent=1))
