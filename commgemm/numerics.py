"""`compare()`: how far a result is from its reference, overall and region by region."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class NumericsResult:
    """Truthy when every element satisfies |test - ref| <= atol + rtol * |ref| and is finite."""

    passed: bool
    shape: tuple[int, ...]
    max_diff: float
    mean_diff: float
    median_diff: float
    pct_over: float  # % of elements outside the tolerance
    worst_index: tuple[int, ...]
    worst_ref: float
    worst_test: float
    nan_count: int
    inf_count: int
    regions: tuple[tuple[tuple[int, int], float, float], ...]  # ((row, col), mean_diff, % bad)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        lines = [
            f"{'PASS' if self.passed else 'FAIL'} shape={self.shape} max_diff={self.max_diff:.3e} "
            f"mean_diff={self.mean_diff:.3e} median_diff={self.median_diff:.3e} "
            f"over_tol={self.pct_over:.2f}%",
            f"  worst at {self.worst_index}: ref={self.worst_ref:.6g} test={self.worst_test:.6g}",
        ]
        if self.nan_count or self.inf_count:
            lines.append(f"  non-finite in test: {self.nan_count} NaN, {self.inf_count} Inf")
        for (r, c), mean, bad in self.regions:
            lines.append(f"  region ({r},{c}): mean_diff={mean:.3e} bad={bad:.2f}%")
        return "\n".join(lines)


def _as_2d(a: jax.Array) -> jax.Array:
    if a.ndim == 0:
        return a.reshape(1, 1)
    if a.ndim == 1:
        return a.reshape(1, -1)
    return a.reshape(-1, a.shape[-1])


@jax.jit
def _stats(ref: jax.Array, test: jax.Array, atol: float, rtol: float):
    wide = jnp.promote_types(jnp.promote_types(ref.dtype, test.dtype), jnp.float32)
    ref, test = ref.astype(wide), test.astype(wide)
    finite = jnp.isfinite(test)
    diff = jnp.where(finite, jnp.abs(test - ref), jnp.inf)
    bad = diff > atol + rtol * jnp.abs(ref)
    worst = jnp.argmax(jnp.where(finite, diff, jnp.inf))
    shown = jnp.where(finite, diff, 0.0)
    return dict(
        max_diff=jnp.max(diff),
        mean_diff=jnp.mean(shown),
        median_diff=jnp.median(shown),
        pct_over=100.0 * jnp.mean(bad),
        worst=worst,
        worst_ref=ref.reshape(-1)[worst],
        worst_test=test.reshape(-1)[worst],
        nan_count=jnp.sum(jnp.isnan(test)),
        inf_count=jnp.sum(jnp.isinf(test)),
        diff=shown,
        bad=bad,
    )


def compare(
    ref: jax.Array | np.ndarray,
    test: jax.Array | np.ndarray,
    *,
    atol: float,
    rtol: float,
    region_grid: tuple[int, int] = (2, 2),
) -> NumericsResult:
    """Compares `test` with `ref` elementwise (reductions run where the arrays live; only scalars
    come back, so sharded arrays are not gathered).

    Regions: the 2-D view [rows, last dim] cut in region_grid[0] x region_grid[1] blocks (the
    last ones take the remainder). NaN or Inf in `test` always fail and are counted.
    """
    if np.shape(ref) != np.shape(test):
        raise ValueError(f"ref has shape {np.shape(ref)} but test has {np.shape(test)}")
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol={atol} and rtol={rtol} must be >= 0")
    rows, cols = region_grid
    if rows < 1 or cols < 1:
        raise ValueError(f"region_grid={region_grid} must be positive")
    ref, test = jnp.asarray(ref), jnp.asarray(test)
    shape = tuple(ref.shape)
    s = _stats(_as_2d(ref), _as_2d(test), atol, rtol)
    diff, bad = s["diff"], s["bad"]
    r_edges = np.linspace(0, diff.shape[0], rows + 1).astype(int)
    c_edges = np.linspace(0, diff.shape[1], cols + 1).astype(int)
    regions = []
    for i in range(rows):
        for j in range(cols):
            block = (slice(r_edges[i], r_edges[i + 1]), slice(c_edges[j], c_edges[j + 1]))
            if diff[block].size == 0:
                continue
            regions.append(
                ((i, j), float(jnp.mean(diff[block])), float(100.0 * jnp.mean(bad[block])))
            )
    nan_count, inf_count = int(s["nan_count"]), int(s["inf_count"])
    pct_over = float(s["pct_over"])
    return NumericsResult(
        passed=pct_over == 0.0 and nan_count == 0 and inf_count == 0,
        shape=shape,
        max_diff=float(s["max_diff"]),
        mean_diff=float(s["mean_diff"]),
        median_diff=float(s["median_diff"]),
        pct_over=pct_over,
        worst_index=tuple(int(i) for i in np.unravel_index(int(s["worst"]), shape or (1,))),
        worst_ref=float(s["worst_ref"]),
        worst_test=float(s["worst_test"]),
        nan_count=nan_count,
        inf_count=inf_count,
        regions=tuple(regions),
    )
