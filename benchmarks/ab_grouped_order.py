"""Probe in one run: the grouped kernel's tile order (which CTA runs which output tile when),
for G in {8, 64}: LPT dealing by cost (the kernel's), the plain walk (row-major), a column-major
walk, per-round snake dealing over the column-major walk, LPT with ties column-major.
    PYTHONPATH=. python3 benchmarks/ab_grouped_order.py --out DIR"""
import argparse, json, pathlib, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from grouped_gemm import uneven_sizes, timed, KERNELS
from commgemm.mosaic_gpu import grouped_kernel as gk
from commgemm.mosaic_gpu import grouped as hopper
from commgemm.mosaic_gpu import tiles as mt

p = argparse.ArgumentParser(); p.add_argument("--out", type=pathlib.Path, required=True)
a = p.parse_args(); a.out.mkdir(parents=True, exist_ok=True)
m, k, n = 8192, 4096, 1792
tiles = gk.GroupedConfig(); ctas = mt.num_sms()
tm, tn = m // tiles.cta_m, n // tiles.cta_n
T = tm * tn
walk = jnp.arange(T, dtype=jnp.int32)
mi, ni = [np.asarray(v) for v in jax.vmap(lambda t: mt.cluster_tile(tiles, t, tm, tn))(walk)]
orig = gk.schedule

def halves(sizes):
    ends = np.minimum(np.cumsum(sizes), m); starts = np.concatenate([[0], ends[:-1]])
    owner = np.full(m, -1)
    for g in range(len(sizes)): owner[starts[g]:ends[g]] = g
    blk = [len({int(g) for g in owner[b:b + 64] if g >= 0}) for b in range(0, m, 64)]
    per_tile = np.array([max(blk[2 * t] + blk[2 * t + 1], 1) for t in range(tm)])
    return per_tile[mi]  # per walk index

def snake_rounds(cost, seq):
    """seq: tiles in an order; per round of ctas, deal by cost desc in a snake."""
    units = np.empty(T, np.int64); load = np.zeros(ctas)
    for r0 in range(0, T, ctas):
        chunk = seq[r0:r0 + ctas]
        byc = chunk[np.argsort(-cost[chunk], kind="stable")]
        free = np.argsort(load, kind="stable")[:len(chunk)]  # least-loaded CTAs first
        for t, c in zip(byc, free):
            units[r0 + np.where(free == c)[0][0]] = t  # placeholder, fixed below
        # unit index u = c + r*ctas: CTA c's r-th tile
        r = r0 // ctas
        for t, c in zip(byc, free):
            load[c] += cost[t]
    return units, load

def policy_order(name, sizes):
    cost = halves(sizes)
    cm = np.lexsort((mi, ni))  # column-major walk
    if name == "walk-rm": return np.arange(T), None
    if name == "walk-cm": return cm, None
    if name == "lpt-cm":
        seq = cm[np.argsort(-cost[cm], kind="stable")]
        slots = gk.balanced_slots(T, ctas); order = np.zeros(T, np.int64); order[slots] = seq
        return order, None
    if name in ("rounds-cm", "rounds-rm"):
        seq = cm if name == "rounds-cm" else np.arange(T)
        order = np.full(T, -1); load = np.zeros(ctas); rounds = -(-T // ctas)
        per_cta = [[] for _ in range(ctas)]
        for r0 in range(0, T, ctas):
            chunk = seq[r0:r0 + ctas]
            byc = chunk[np.argsort(-cost[chunk], kind="stable")]
            free = np.argsort(load, kind="stable")[:len(chunk)]
            for t, c in zip(byc, free):
                per_cta[c].append(t); load[c] += cost[t]
        # the kernel runs unit c + r*ctas on CTA c: CTAs with fewer tiles need the last round
        need = sorted(range(ctas), key=lambda c: -len(per_cta[c]))
        assert all(len(per_cta[c]) <= rounds for c in range(ctas))
        # units c + r*ctas exist for r < rounds - 1 for all c, and for r = rounds-1 for c < T % ctas (or all)
        full = T - (rounds - 1) * ctas
        # remap CTAs: those with `rounds` tiles must be CTAs 0..full-1
        big = [c for c in range(ctas) if len(per_cta[c]) == rounds]
        small = [c for c in range(ctas) if len(per_cta[c]) < rounds]
        if len(big) != full: return None, None
        for newc, c in enumerate(big + small):
            for r, t in enumerate(per_cta[c]): order[newc + r * ctas] = t
        assert sorted(order.tolist()) == list(range(T))
        return order, None
    raise ValueError(name)

def makespan(order, cost):
    load = np.zeros(ctas)
    for u, t in enumerate(order): load[u % ctas] += cost[t]
    return float(load.max()), float(load.mean())

POL = ["lpt", "walk-rm", "walk-cm", "lpt-cm", "rounds-cm", "rounds-rm"]
rows = []
for groups in (8, 64):
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    sz = uneven_sizes(groups, m, groups); sizes = jnp.asarray(sz)
    cost = halves(sz)
    ref = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes, precision="highest")
    v, spans, errs = {}, {}, {}
    for name in POL:
        if name == "lpt":
            fn = jax.jit(lambda a_, b_, s_: gk.grouped_matmul(a_, b_, s_))
            spans[name] = makespan(np.asarray(orig(sizes, tiles, m, n, ctas).order), cost)
        else:
            order, _ = policy_order(name, sz)
            if order is None: continue
            spans[name] = makespan(order, cost)
            oj = jnp.asarray(order, jnp.int32)
            def sched(s_, t_, m_, n_, c_, oj=oj):
                return __import__("dataclasses").replace(orig(s_, t_, m_, n_, c_), order=oj)
            def f(a_, b_, s_, sched=sched):
                gk.schedule = sched
                try: return gk.grouped_matmul(a_, b_, s_)
                finally: gk.schedule = orig
            fn = jax.jit(f)
        v[name] = (fn, (x, w, sizes))
        got = fn(-x, w, sizes).astype(jnp.float32)
        errs[name] = float(jnp.abs(got + ref).max() / jnp.abs(ref).max())
    v["jax fwd"] = (jax.jit(lambda a_, b_, s_: hopper.product(a_, b_, s_, KERNELS["jax kernel"], False)), (x, w, sizes))
    v["dense XLA"] = (jax.jit(lambda a_, b_: a_ @ b_), (x, w[0]))
    times, timing = timed(v)
    row = dict(groups=groups, timing=timing, ms=times, makespan_halves=spans, errs=errs)
    rows.append(row); print(json.dumps(row), flush=True)
(a.out / "ab_grouped_order.json").write_text(json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows), indent=1))
