"""One small validated config per fused kernel family: the ring kernels (`RingAGConfig`,
`RingRSConfig`, ATOMIC_GEMM_AG_P2P / _RS_P2P) and the direct ones (`DirectAGConfig`,
`DirectRSConfig`, ATOMIC_GEMM_AG / _RS; `PingPongRSConfig` and `PingPongAGConfig`, ATOMIC_GEMM_RS
and _AG on the ping-pong schedule); and the grouped kernels' (`GroupedConfig`, `PingPongTiles`).

Every fused family but the ping-pong ones (and `GroupedConfig`) shares the GEMM tiling of jax's
Hopper matmul (its `TuningConfig`): each of a CTA's two compute warpgroups owns a tile_m x
tile_n block (stacked along N, or along M with wg_along_m); `stages` K-steps of tile_k are
loaded ahead; CTAs walk the output tiles in bands `grid_tile_width` tiles wide along N (along M
with grid_minor_m); the epilogue stores in EPI x EPI blocks. `cluster` ("m" or "n", where a
family has it) pairs two CTAs whose shared operand is loaded once and multicast to both.
"""

from __future__ import annotations

import dataclasses
import math

#: The epilogue's block (EPI x EPI elements): what every measured tiling used.
EPI = 64
#: Rows the ping-pong grouped kernel's tiles start at whole multiples of (Mosaic GPU loads
#: tiled shared memory from whole 8s of rows).
ROW_ALIGN = 8
#: Rows of one wgmma of a warpgroup: its tiles' rows are whole multiples of it.
WGMMA_M = 64
#: Most columns of one wgmma.
WGMMA_N = 256
#: Rows of the load warpgroups' zero blocks (`zero_ahead`): 16 x 64, 2 KiB in bf16, what shared
#: memory has left beside 4 stages of 128 x 256 tiles and the epilogue's (5 of 128 x 192 in the
#: ping-pong kernel).
ZERO_ROWS = 16
#: Most float32 registers a thread of a ping-pong kernel's compute warpgroup gives its
#: accumulator (a whole tile's: tile_m x tile_n / 128), leaving room for the rest of its 232.
ACC_REGISTERS = 192
#: K-steps of the float8 kernels where K allows: 128 bytes a row, the widest shared-memory
#: swizzle, and the same shared memory as 64 steps of 16-bit operands.
FLOAT8_TILE_K = 128


def _positive_int(value: object, field: str, family: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{family}.{field}={value!r} must be a positive int")


def _check_pingpong_tile(family: str, tiles) -> None:
    """The checks a ping-pong tiling's stages, tile_m and tile_n share: at least 2 stages,
    rows whole wgmma rows, columns whole 8s up to WGMMA_N (one wgmma's)."""
    if tiles.stages < 2:
        raise ValueError(f"{family}.stages={tiles.stages} must be >= 2")
    if tiles.tile_m % WGMMA_M:
        raise ValueError(
            f"{family}.tile_m={tiles.tile_m} must be whole {WGMMA_M}s (a warpgroup's wgmma rows)"
        )
    if tiles.tile_n % 8 or tiles.tile_n > WGMMA_N:
        raise ValueError(
            f"{family}.tile_n={tiles.tile_n} must be whole 8s up to {WGMMA_N} (wgmma's columns)"
        )


@dataclasses.dataclass(frozen=True)
class _Tiling:
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    wg_along_m: bool = False
    grid_tile_width: int = 8
    grid_minor_m: bool = False

    def __post_init__(self) -> None:
        family = type(self).__name__
        for field in ("tile_m", "tile_n", "tile_k", "stages", "grid_tile_width"):
            _positive_int(getattr(self, field), field, family)
        for field in ("wg_along_m", "grid_minor_m"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{family}.{field}={getattr(self, field)!r} must be a bool")
        if self.stages < 2:
            raise ValueError(f"{family}.stages={self.stages} must be >= 2")
        if self.tile_m % EPI or self.tile_n % EPI:
            raise ValueError(
                f"{family}: tile_m={self.tile_m} and tile_n={self.tile_n} must be multiples of "
                f"the epilogue block {EPI}"
            )
        cluster = getattr(self, "cluster", None)
        if cluster not in self._clusters:
            raise ValueError(f"{family}.cluster={cluster!r} must be one of {self._clusters}")
        narrow = getattr(self, "narrow_tail", False)
        if not isinstance(narrow, bool) and not (narrow is None and self._narrow_auto):
            kinds = "a bool or None (automatic)" if self._narrow_auto else "a bool"
            raise ValueError(f"{family}.narrow_tail={narrow!r} must be {kinds}")
        if narrow and (self.cta_m % (2 * EPI) or self.cta_n % (2 * EPI)):
            raise ValueError(
                f"{family}.narrow_tail splits a {self.cta_m} x {self.cta_n} CTA tile into "
                f"warpgroup tiles of half its rows and columns, whole {EPI}s: cta_m and cta_n "
                f"must be multiples of {2 * EPI}"
            )

    _clusters = (None,)  # the clusters a family allows (a class attribute, not a field)
    _narrow_auto = False  # whether narrow_tail may be None, decided per call
    epi = EPI

    @property
    def cluster_size(self) -> int:
        return 1 if getattr(self, "cluster", None) is None else 2

    @property
    def cta_m(self) -> int:
        return self.tile_m * (2 if self.wg_along_m else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (1 if self.wg_along_m else 2)

    @property
    def cluster_m(self) -> int:
        """Rows of output one cluster computes per tile."""
        return self.cta_m * (2 if getattr(self, "cluster", None) == "m" else 1)

    @property
    def cluster_n(self) -> int:
        return self.cta_n * (2 if getattr(self, "cluster", None) == "n" else 1)


@dataclasses.dataclass(frozen=True)
class RingAGConfig(_Tiling):
    """ATOMIC_GEMM_AG_P2P (`direct_ag` with ring=True): each band of rows is forwarded to
    the next device while it is multiplied; step s multiplies the block that arrived in step
    s-1. No clusters."""


@dataclasses.dataclass(frozen=True)
class RingRSConfig(_Tiling):
    """ATOMIC_GEMM_RS_P2P: at step s the epilogue adds the partial sum received from the
    previous device and writes the tile into the next device's buffer."""

    cluster: str | None = None
    _clusters = (None, "m", "n")


@dataclasses.dataclass(frozen=True)
class DirectAGConfig(_Tiling):
    """ATOMIC_GEMM_AG (`direct_ag`): rows pushed to every peer, flagged per band.

    spread: percent (0 to 100) of the schedule after the first wave over which this device's own
    tiles (the ones that send x's rows) are interleaved with the peers'; 0 runs them first.
    cluster: "m" only (the pair shares w's blocks).
    narrow_tail: the tiles of the last, partly filled wave of CTAs run as two tiles of half
      their columns each, where those fit in one wave (`direct_ag.narrow_tail`); needs
      cta_m and cta_n multiples of 128.
    """

    cluster: str | None = None
    spread: int = 0
    narrow_tail: bool = False
    _clusters = (None, "m")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.spread, bool) or not isinstance(self.spread, int):
            raise ValueError(f"DirectAGConfig.spread={self.spread!r} must be an int")
        if not 0 <= self.spread <= 100:
            raise ValueError(f"DirectAGConfig.spread={self.spread} must be from 0 to 100")


@dataclasses.dataclass(frozen=True)
class DirectRSConfig(_Tiling):
    """ATOMIC_GEMM_RS (`direct_rs`): every tile reduce-added straight into its owner.

    chain_tiles: a CTA's tiles run as one pipeline (the next tile's loads start before this one's
      epilogue); needs K/tile_k divisible by stages and two tiles per CTA.
    split_tail: s > 1 splits each tile of the last, partly filled wave of CTAs into s K-ranges;
      0 picks s, or the tail streamed, from a model of the wave; 1 leaves the tail whole.
    stream_tail: the K-steps of the last, partly filled wave's tiles are dealt evenly to every
      CTA (cluster), each a contiguous run of them that spans at most two tiles (stream-K);
      instead of split_tail, which must then be 0 or 1.
    zero_ahead: D > 0 zeroes the output D waves of CTAs ahead of the adds; 0 zeroes it first.
    """

    cluster: str | None = None
    chain_tiles: bool = False
    split_tail: int = 1
    stream_tail: bool = False
    zero_ahead: int = 0
    _clusters = (None, "m", "n")

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("chain_tiles", "stream_tail"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"DirectRSConfig.{field}={getattr(self, field)!r} must be a bool")
        for field, what in (("split_tail", "0: automatic"), ("zero_ahead", "0: all first")):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DirectRSConfig.{field}={value!r} must be an int >= 0 ({what})")
        if self.stream_tail and self.split_tail > 1:
            raise ValueError(
                f"DirectRSConfig: stream_tail deals the tail's K-steps itself; split_tail="
                f"{self.split_tail} asks for a split as well (leave it 0 or 1)"
            )


@dataclasses.dataclass(frozen=True)
class GroupedConfig(_Tiling):
    """The grouped GEMM's kernel (`grouped_kernel`): 64 x 256 tiles a compute warpgroup,
    stacked along M (each warpgroup zeroes its own rows of a shared x block where a tile
    straddles a group boundary, so wg_along_m must stay True).

    narrow_tail: the tiles of the last, partly filled wave of CTAs run as two tiles of half
      their columns each, where those fit in one wave (as `DirectAGConfig.narrow_tail`);
      None: where the kernel's model of its schedule says it pays
      (`grouped_kernel.narrowing_pays`)."""

    tile_m: int = 64
    tile_n: int = 256
    wg_along_m: bool = True
    narrow_tail: bool | None = None
    _narrow_auto = True

    def __post_init__(self) -> None:
        if self.wg_along_m is not True:
            raise ValueError(
                "GroupedConfig.wg_along_m must be True: each compute warpgroup "
                "masks the rows of x it multiplies"
            )
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class PingPongTiles:
    """The ping-pong grouped kernel's tiling (`grouped_pingpong`): tile_m x tile_n tiles, one per
    compute warpgroup, K-steps of tile_k, `stages` slots in the ring the two share, CTAs
    walking the tiles in bands `band` row tiles wide. The defaults were the fastest of the few
    measured; shared memory holds stages x (tile_m + tile_n) x tile_k operands
    and two tile_m x tile_n results (fewer stages where they do not fit:
    `grouped_pingpong.ring_stages`). tile_m is whole 64s, tile_n whole 8s up to 256 (whole 64s
    for 16-bit w read [G, K, N]: `grouped_pingpong.shape_reason`)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 5
    band: int = 4

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _positive_int(getattr(self, field.name), field.name, "PingPongTiles")
        _check_pingpong_tile("PingPongTiles", self)


#: Shared memory a CTA may use on Hopper (227 KiB).
HOPPER_SMEM = 227 * 1024


@dataclasses.dataclass(frozen=True)
class _PingPong:
    """The tiling the ping-pong kernels share (`pingpong`): each compute warpgroup owns a whole
    tile_m x tile_n output tile and the two take a CTA's tiles in turn, so one's epilogue runs
    under the other's K loop. One ring of `stages` smem slots of tile_k K-steps is shared by
    both; the two warpgroups' epilogues share one buffer of 64 rows. CTAs walk the tiles in
    bands `grid_tile_width` tiles wide (along M with grid_minor_m); cluster "m" pairs two CTAs
    of adjacent row tiles that share w's blocks (multicast). The last column of tiles may be
    partial: N need not be whole tiles (nor M in the RS kernel's core). tile_n is
    whole 8s up to 256, tile_m x tile_n at most 128 x 192 (the accumulator is tile_m x tile_n /
    128 registers a thread: at most 192 leaves room for the rest); with w read [K, n] (bf16 and
    fp16) tile_n is whole 64s. narrow_tail: the tiles of a last wave that fills at most half
    the clusters (after a full one) run as two units of half their rows each
    (`pingpong.deal`; tile_m whole 128s). The defaults are cuBLASLt's schedule in 128 x 192
    tiles."""

    tile_m: int = 128
    tile_n: int = 192
    tile_k: int = 64
    stages: int = 5
    grid_tile_width: int = 8
    grid_minor_m: bool = True
    cluster: str | None = "m"
    narrow_tail: bool = True

    def __post_init__(self) -> None:
        family = type(self).__name__
        for field in ("tile_m", "tile_n", "tile_k", "stages", "grid_tile_width"):
            _positive_int(getattr(self, field), field, family)
        for field in ("grid_minor_m", "narrow_tail"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{family}.{field}={getattr(self, field)!r} must be a bool")
        if self.cluster not in (None, "m"):
            raise ValueError(f"{family}.cluster={self.cluster!r} must be one of (None, 'm')")
        _check_pingpong_tile(family, self)
        if self.tile_m * self.tile_n > ACC_REGISTERS * 128:
            raise ValueError(
                f"{family}: a {self.tile_m} x {self.tile_n} tile's accumulator takes more than "
                f"{ACC_REGISTERS} registers a thread of a warpgroup"
            )

    @property
    def cluster_size(self) -> int:
        return 1 if self.cluster is None else 2

    @property
    def cluster_m(self) -> int:
        """Rows of output one cluster computes per tile."""
        return self.tile_m * self.cluster_size

    def smem_bytes(self, itemsize: int, out_itemsize: int) -> int:
        """Shared memory of the ring and the epilogue buffer (EPI rows of a tile)."""
        ring = self.stages * (self.tile_m + self.tile_n) * self.tile_k * itemsize
        return ring + EPI * self.tile_n * out_itemsize


@dataclasses.dataclass(frozen=True)
class PingPongRSConfig(_PingPong):
    """ATOMIC_GEMM_RS on the ping-pong schedule (`pingpong_rs`; the tiling: `_PingPong`).
    zero_ahead: D > 0 zeroes the output D waves of CTAs ahead of the adds (the load warpgroup,
    between two tiles' loads); 0 zeroes it all first."""

    zero_ahead: int = 2

    def __post_init__(self) -> None:
        family = "PingPongRSConfig"
        if isinstance(self.zero_ahead, bool) or not isinstance(self.zero_ahead, int):
            raise ValueError(f"{family}.zero_ahead={self.zero_ahead!r} must be an int >= 0")
        if self.zero_ahead < 0:
            raise ValueError(f"{family}.zero_ahead={self.zero_ahead} must be >= 0 (0: all first)")
        super().__post_init__()

    @property
    def zero_columns(self) -> int:
        """Columns of the load warpgroup's zero block (zero_ahead): a divisor of tile_n."""
        return math.gcd(self.tile_n, EPI)

    def smem_bytes(self, itemsize: int, out_itemsize: int) -> int:
        """`_PingPong.smem_bytes` and, with zero_ahead, the zero block (ZERO_ROWS x
        zero_columns)."""
        zero = ZERO_ROWS * self.zero_columns if self.zero_ahead else 0
        return super().smem_bytes(itemsize, out_itemsize) + zero * out_itemsize


@dataclasses.dataclass(frozen=True)
class PingPongAGConfig(_PingPong):
    """ATOMIC_GEMM_AG on the ping-pong schedule (`pingpong_ag`; the tiling:
    `_PingPong`): the own rows pushed to every peer from the ring's slots, flagged per band."""


KernelConfig = (
    RingAGConfig
    | RingRSConfig
    | DirectAGConfig
    | DirectRSConfig
    | PingPongRSConfig
    | PingPongAGConfig
)
#: The ping-pong kernels' configs.
PINGPONG_FAMILIES = (PingPongRSConfig, PingPongAGConfig)
#: The configs of the kernels that method PIPELINE runs (the others are RING_EXCHANGE's).
PIPELINE_FAMILIES = (DirectAGConfig, DirectRSConfig, *PINGPONG_FAMILIES)
#: The family of each config type, by name (the tune cache's tag).
FAMILIES: dict[str, type] = {
    c.__name__: c
    for c in (RingAGConfig, RingRSConfig, DirectAGConfig, DirectRSConfig, *PINGPONG_FAMILIES)
}
