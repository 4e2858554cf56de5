"""The direct RS kernel's schedule (`direct_rs`), as plain functions of the tile counts:
which tile and owner each unit of the main loop runs, the last, partly filled wave's tiles (the
tail: split along K or streamed), and which tiles each wave of CTAs adds into first (the
zeroing ahead). Python ints in give ints out; traced values in give traced values out (the
kernel's). The ping-pong RS kernel zeroes by the same waves (`pingpong_rs`)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from commgemm.mosaic_gpu.configs import DirectRSConfig

#: What a tail unit costs beyond its K-steps (epilogue, pipeline ramp), in K-steps: the
#: automatic split_tail's model.
TAIL_OVERHEAD_STEPS = 2
#: The same for each of the two pieces of a streamed share (its pipeline's grid is dynamic):
#: fitted to nine RS cores on one GPU, where streaming gained 1.1% at 64 K-steps a tile,
#: 0.2 to 0.3% at 32, and lost up to 0.5% at 16.
STREAM_OVERHEAD_STEPS = 5
#: tail_plan's splits for a streamed tail (DirectRSConfig.stream_tail): `stream_pieces`.
STREAMED = 0


def tail_plan(
    num_tiles: int, per_block: int, ctas: int, k_iters: int, tiles: DirectRSConfig
) -> tuple[int, int]:
    """(tail tiles, splits): the tiles of the last, partly filled wave (`num_tiles % ctas`) and
    how many K-ranges each is split into (DirectRSConfig.split_tail; 1: no tail; STREAMED with
    stream_tail: their K-steps dealt to every CTA, `stream_pieces`). The tail tiles are this
    device's own, so their partial sums add up here, not over NVLink. A split must divide
    K/tile_k into ranges of at least `stages` steps; 0 picks the split that minimises
    ceil(tail * s / ctas) * (k_iters / s + TAIL_OVERHEAD_STEPS), 1 included, or the stream
    where its share and two pieces' STREAM_OVERHEAD_STEPS cost less."""
    tail = num_tiles % ctas
    split = tiles.split_tail
    if tail == 0 or (split == 1 and not tiles.stream_tail):
        return 0, 1
    if (reason := tail_reason(num_tiles, per_block, ctas, tiles)) is not None:
        raise ValueError(reason)
    if tiles.stream_tail:
        return tail, STREAMED
    # 1 (whole) and the splits into ranges of at least `stages` steps
    valid = [1] + [s for s in range(2, k_iters // tiles.stages + 1) if k_iters % s == 0]
    if split:
        if split not in valid:
            raise ValueError(
                f"DirectRSConfig.split_tail={split} must divide K/tile_k={k_iters} into ranges of "
                f"at least {tiles.stages} steps (stages)"
            )
    else:
        if tail > per_block:
            return 0, 1

        def cost(s: int) -> float:
            return -(-tail * s // ctas) * (k_iters / s + TAIL_OVERHEAD_STEPS)

        split = min(valid, key=cost)
        if stream_share(tail, k_iters, ctas) + 2 * STREAM_OVERHEAD_STEPS < cost(split):
            return tail, STREAMED
    return (tail, split) if split > 1 else (0, 1)


def tail_reason(num_tiles: int, per_block: int, ctas: int, tiles: DirectRSConfig) -> str | None:
    """Why `tiles`' explicit tail (split_tail > 1 or stream_tail) cannot run `num_tiles`
    tiles, `per_block` a device, on `ctas` CTAs, or None: the tail's tiles must be this
    device's own, so the last wave's tiles must fit in one block."""
    tail = num_tiles % ctas
    if tail <= per_block or not (tiles.split_tail > 1 or tiles.stream_tail):
        return None
    what = "stream_tail" if tiles.stream_tail else "split_tail"
    return (
        f"DirectRSConfig.{what} needs the tail ({tail} tiles) within one block ({per_block} tiles)"
    )


def stream_share(tail_tiles: int, k_iters: int, ctas: int) -> int:
    """K-steps of a streamed tail each of `ctas` CTAs runs (the last ones fewer): the tail's
    tail_tiles x k_iters steps dealt evenly. Less than k_iters, as the tail is less than a
    wave, so a share spans at most two tiles."""
    return -(-tail_tiles * k_iters // ctas)


def stream_pieces(cta, share: int, per_block: int, tail_tiles: int, k_iters: int):
    """The two pieces, each (tile, first K-step, K-steps), of the `cta`-th CTA's share of a
    streamed tail: K-steps [cta * share, (cta + 1) * share) of the tail's tiles (the block's
    last `tail_tiles`) laid end to end, clipped to them. A piece of 0 steps is not run."""
    start = cta * share
    end = _min(start + share, tail_tiles * k_iters)
    tile = start // k_iters
    first_k = start - tile * k_iters
    first = _max(_min(k_iters - first_k, end - start), 0)
    second = _max(end - (tile + 1) * k_iters, 0)
    base = per_block - tail_tiles
    return (base + tile, first_k, first), (base + tile + 1, 0, second)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _rem(a, n: int):
    return a % n if isinstance(a, int) else lax.rem(a, jnp.int32(n))


def _select(pred, a, b):
    return (a if pred else b) if isinstance(pred, bool) else jnp.where(pred, a, b)


def main_unit(lin, size: int, per_block: int, tail_tiles: int):
    """(tile, offset) of the main loop's `lin`-th unit: the P blocks' copies of one tile are
    consecutive (offset: the owner's distance from here), except that the peers' copies of the
    last `tail_tiles` tiles come last (their own copies are the tail's). Python ints in, ints
    out; traced in, traced out."""
    tile, offset = lin // size, _rem(lin, size)
    if not tail_tiles or size == 1:  # one device: the main loop's tiles come in order
        return tile, offset
    late = lin - size * (per_block - tail_tiles)
    in_late = late >= 0
    tile = _select(in_late, per_block - tail_tiles + late // (size - 1), tile)
    offset = _select(in_late, 1 + _rem(late, size - 1), offset)
    return tile, offset


def wave_tiles(wave, ctas: int, main_units: int, size: int, per_block: int, tail_tiles: int):
    """[lo, hi): the tiles (of every block) first added into by the main loop's `wave`-th wave
    of `ctas` units. Every unit of a wave adds into a tile below its wave's hi, and the waves'
    ranges follow one another, so zeroing wave w's range before wave w runs is enough
    (DirectRSConfig.zero_ahead). The last wave's hi is per_block (the tail's tiles included)."""

    def last_tile(w):
        lin = (w + 1) * ctas - 1
        lin = min(lin, main_units - 1) if isinstance(lin, int) else jnp.minimum(lin, main_units - 1)
        return main_unit(lin, size, per_block, tail_tiles)[0]

    before = wave - 1 if isinstance(wave, int) else jnp.maximum(wave - 1, 0)
    return _select(wave == 0, 0, last_tile(before) + 1), last_tile(wave) + 1


class ZeroPlan(NamedTuple):
    """A reduce-adding kernel's zeroing (zero_ahead = D): the compute warpgroups zero the first
    `ahead` waves' tiles (`first_tiles` a block) first; with `late_zero` the load warpgroups
    zero each later wave's D waves early, at most `late_iters` ZERO_ROWS bands a CTA."""

    waves: int
    ahead: int
    late_zero: bool
    first_tiles: int
    late_iters: int


def zero_plan(
    zero_ahead: int,
    ctas: int,
    main_units: int,
    size: int,
    per_block: int,
    tail_tiles: int,
    bands: int,
    sms: int,
) -> ZeroPlan:
    """The ZeroPlan of `main_units` units on `ctas` CTAs (`sms` SMs), `size` blocks of
    `per_block` tiles (`tail_tiles` each past the main loop), `bands` bands a tile."""
    waves = -(-main_units // ctas)
    ahead = min(zero_ahead, waves) if zero_ahead else waves
    first_tiles = wave_tiles(ahead - 1, ctas, main_units, size, per_block, tail_tiles)[1]
    spans = [
        wave_tiles(w, ctas, main_units, size, per_block, tail_tiles) for w in range(ahead, waves)
    ]
    late_iters = max([-(-(hi - lo) * bands // sms) for lo, hi in spans], default=0)
    return ZeroPlan(waves, ahead, size > 1 and ahead < waves, first_tiles, late_iters)


def zero_bands_per_tile(tiles: DirectRSConfig, block_m: int) -> int:
    """How many bands of block_m rows (the zeroing's units) one cluster tile of the output
    has."""
    return tiles.cluster_m // block_m


def tail_unit(unit, per_block: int, tail_tiles: int, splits: int):
    """(tile, part) of the tail's `unit`-th unit: the part-th of `splits` K-ranges of one of this
    device's last `tail_tiles` tiles."""
    return per_block - tail_tiles + unit // splits, lax.rem(unit, jnp.int32(splits))
