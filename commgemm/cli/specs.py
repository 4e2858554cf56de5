"""The method specs of the CLI (`commgemm bench --methods`, `commgemm tune --methods`):
'none', 'pipeline:4', 'ring', 'ring-bidi:2', 'fused-direct-cm', ... as `OverlapConfig`s and
back. Only the command line speaks this language; the library and the tune cache take configs.
"""

from __future__ import annotations

from commgemm.config import FusedTiles, Method, OverlapConfig


def parse_fused(spec: str) -> OverlapConfig:
    """'fused' (the ring kernels, RING_EXCHANGE) or 'fused-direct' (method PIPELINE, no ring:
    ATOMIC_GEMM_AG pushes x's rows to every peer, ATOMIC_GEMM_RS reduce-adds tiles into their
    owner), with optional tiling suffixes: '-w8' (grid_tile_width), '-s3' (stages), '-wgm'
    (warpgroups along M), '-gm' (grid along M), '-m256' / '-n64' / '-k128' (tile_m / tile_n /
    tile_k), '-e128' (epilogue blocks), '-cm' / '-cn' (2-CTA clusters along M / N), '-d1'
    (release_lag), '-ct' (chain_tiles), '-p1' (senders), '-t4' / '-t0' (split_tail, 0
    automatic), '-r80' (spread), '-a3' (zero_ahead), e.g. 'fused-wgm-w8', 'fused-direct-cm-w16'."""
    fields: dict[str, object] = {}
    keys = {
        "w": "grid_tile_width",
        "s": "stages",
        "m": "tile_m",
        "n": "tile_n",
        "k": "tile_k",
        "e": "epi",
        "d": "release_lag",
        "p": "senders",
        "t": "split_tail",
        "r": "spread",
        "a": "zero_ahead",
    }
    method = "ring_exchange"
    for part in spec.split("-")[1:]:
        if part == "direct" and method == "ring_exchange":
            method = "pipeline"
        elif part == "wgm":
            fields["wg_along_m"] = True
        elif part == "gm":
            fields["grid_minor_m"] = True
        elif part in ("cm", "cn"):
            fields["cluster"] = part[1]
        elif part == "ct":
            fields["chain_tiles"] = True
        elif part[:1] in keys and part[1:].isdigit():
            fields[keys[part[0]]] = int(part[1:])
        else:
            raise ValueError(
                f"unknown fused tiling {part!r} in {spec!r}; "
                "use -direct, -w<N>, -s<N>, -m<N>, -n<N>, -k<N>, -e<N>, -d<N>, -p<N>, -t<N>, "
                "-r<N>, -a<N>, -wgm, -gm, -cm, -cn, -ct"
            )
    tiles = FusedTiles(**fields) if fields else None
    return OverlapConfig(method=method, atomic_gemm=True, fused_tiles=tiles)


def fused_spec(tiles: FusedTiles | None, *, direct: bool = False) -> str:
    """The inverse of `parse_fused` (direct: the kernels of method PIPELINE)."""
    parts = ["fused", "direct"] if direct else ["fused"]
    default = FusedTiles()
    tiles = tiles or default
    if tiles.wg_along_m:
        parts.append("wgm")
    if tiles.grid_minor_m:
        parts.append("gm")
    if tiles.cluster:
        parts.append(f"c{tiles.cluster}")
    if tiles.chain_tiles:
        parts.append("ct")
    fields = (
        ("m", "tile_m"),
        ("n", "tile_n"),
        ("k", "tile_k"),
        ("s", "stages"),
        ("w", "grid_tile_width"),
    )
    extra = (
        ("e", "epi"),
        ("d", "release_lag"),
        ("p", "senders"),
        ("t", "split_tail"),
        ("r", "spread"),
        ("a", "zero_ahead"),
    )
    for key, field in fields + extra:
        if getattr(tiles, field) != getattr(default, field):
            parts.append(f"{key}{getattr(tiles, field)}")
    return "-".join(parts)


def parse_method(spec: str) -> OverlapConfig:
    """'none', 'pipeline:4', 'ring', 'ring:2', 'ring-bidi', 'ring-bidi:2', 'ring-agg', 'auto',
    'fused' (RING_EXCHANGE with atomic_gemm: one kernel, Hopper GPUs; tilings as in
    `parse_fused`); a '-chain' suffix ('ring:4-chain') turns chain_gemms on."""
    if spec == "fused" or spec.startswith("fused-"):
        return parse_fused(spec)
    spec, chain = (spec[: -len("-chain")], True) if spec.endswith("-chain") else (spec, False)
    name, colon, splits = spec.partition(":")
    if colon and not splits.isdigit():
        raise ValueError(f"method {spec!r}: the part after ':' must be a number of splits")
    num_splits = int(splits) if splits else 1
    table = {
        "none": dict(method="none"),
        "pipeline": dict(method="pipeline"),
        "ring": dict(method="ring_exchange"),
        "ring-bidi": dict(method="ring_exchange", bidirectional=True),
        "ring-agg": dict(method="ring_exchange", aggregate=True),
        "auto": dict(method="auto"),
    }
    if name not in table:
        raise ValueError(f"unknown method {spec!r}; use one of {sorted(table)} with an optional :N")
    try:
        return OverlapConfig(num_splits=num_splits, chain_gemms=chain, **table[name])
    except ValueError as err:
        raise ValueError(f"method {spec!r}: {err}") from None


def spec_of(cfg: OverlapConfig) -> str:
    """The method spec string (as `commgemm bench --methods` takes) of a config."""
    if cfg.atomic_gemm:
        return fused_spec(cfg.fused_tiles, direct=cfg.method is Method.PIPELINE)
    name = {Method.NONE: "none", Method.PIPELINE: "pipeline"}.get(cfg.method)
    if name is None:
        name = "ring-agg" if cfg.aggregate else "ring-bidi" if cfg.bidirectional else "ring"
    if cfg.num_splits > 1 and cfg.method is not Method.NONE:
        name = f"{name}:{cfg.num_splits}"
    return f"{name}-chain" if cfg.chain_gemms else name
