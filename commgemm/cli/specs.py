"""The method specs of the CLI (`commgemm bench --methods`, `commgemm tune --methods`):
'none', 'pipeline:4', 'ring', 'ring-bidi:2', 'fused-direct-cm', ... as `OverlapConfig`s and
back. Only the command line speaks this language; the library and the tune cache take configs.
"""

from __future__ import annotations

from commgemm.config import Method, OverlapConfig
from commgemm.mosaic_gpu.configs import PINGPONG_FAMILIES, PingPongAGConfig, PingPongRSConfig

_KEYS = {
    "w": "grid_tile_width",
    "s": "stages",
    "m": "tile_m",
    "n": "tile_n",
    "k": "tile_k",
    "t": "split_tail",
    "r": "spread",
    "a": "zero_ahead",
}
_FLAGS = {
    "wgm": "wg_along_m",
    "gm": "grid_minor_m",
    "ct": "chain_tiles",
    "nt": "narrow_tail",
    "sk": "stream_tail",
}


def parse_fused(spec: str, op: str) -> OverlapConfig:
    """'fused' (the ring kernels, RING_EXCHANGE) or 'fused-direct' (method PIPELINE, no ring:
    ATOMIC_GEMM_AG pushes x's rows to every peer, ATOMIC_GEMM_RS reduce-adds tiles into their
    owner) for op "ag" or "rs", with optional tiling suffixes: '-w8' (grid_tile_width), '-s3'
    (stages), '-wgm' (warpgroups along M), '-gm' (grid along M), '-m256' / '-n64' / '-k128'
    (tile_m / tile_n / tile_k), '-cm' / '-cn' (2-CTA clusters along M / N), '-ct'
    (chain_tiles), '-nt' (narrow_tail), '-t4' / '-t0' (split_tail, 0 automatic), '-sk'
    (stream_tail), '-r80' (spread), '-a3' (zero_ahead), e.g. 'fused-wgm-w8',
    'fused-direct-cm-w16'; '-pp' after 'fused-direct': the ping-pong kernels
    (`PingPongRSConfig`, `PingPongAGConfig`). The op picks the kernel family
    (`commgemm.mosaic_gpu.configs`), which says which suffixes apply."""
    from commgemm.config import Collective
    from commgemm.mosaic_gpu.fused import FAMILY

    if op not in ("ag", "rs"):
        raise ValueError(f"{spec!r}: the fused kernels are for op ag or rs, not {op!r}")
    fields: dict[str, object] = {}
    method, pingpong = Method.RING_EXCHANGE, False
    for part in spec.split("-")[1:]:
        if part == "direct" and method is Method.RING_EXCHANGE:
            method = Method.PIPELINE
        elif part == "pp" and method is Method.PIPELINE:
            pingpong = True  # its flags' fields start off, as the other families' defaults
            fields = {"grid_minor_m": False, "cluster": None, "narrow_tail": False, **fields}
        elif part in _FLAGS:
            fields[_FLAGS[part]] = True
        elif part in ("cm", "cn"):
            fields["cluster"] = part[1]
        elif part[:1] in _KEYS and part[1:].isdigit():
            fields[_KEYS[part[0]]] = int(part[1:])
        else:
            raise ValueError(
                f"unknown fused tiling {part!r} in {spec!r}; use -direct, -w<N>, -s<N>, -m<N>, "
                "-n<N>, -k<N>, -t<N>, -r<N>, -a<N>, -wgm, -gm, -cm, -cn, -ct, -nt, -sk, -pp (after "
                "-direct)"
            )
    family = FAMILY[(Collective(op), method)]
    if pingpong:
        family = PingPongRSConfig if op == "rs" else PingPongAGConfig
    try:
        kernel = family(**fields) if fields or pingpong else None
    except TypeError:
        unknown = sorted(set(fields) - set(family.__dataclass_fields__))
        raise ValueError(f"{spec!r}: {family.__name__} has no {unknown}") from None
    return OverlapConfig(method=method, atomic_gemm=True, kernel=kernel)


def fused_spec(config: OverlapConfig) -> str:
    """The inverse of `parse_fused`: the spec of an atomic_gemm config."""
    parts = ["fused", "direct"] if config.method is Method.PIPELINE else ["fused"]
    kernel = config.kernel
    if kernel is None:
        return "-".join(parts)
    default = type(kernel)()
    if isinstance(kernel, PINGPONG_FAMILIES):
        parts.append("pp")
    for key, field in (("wgm", "wg_along_m"), ("gm", "grid_minor_m")):
        if getattr(kernel, field, False):
            parts.append(key)
    if getattr(kernel, "cluster", None):
        parts.append(f"c{kernel.cluster}")
    if getattr(kernel, "chain_tiles", False):
        parts.append("ct")
    if getattr(kernel, "narrow_tail", False):
        parts.append("nt")
    if getattr(kernel, "stream_tail", False):
        parts.append("sk")
    for key in ("m", "n", "k", "s", "w", "t", "r", "a"):
        field = _KEYS[key]
        if hasattr(kernel, field) and getattr(kernel, field) != getattr(default, field):
            parts.append(f"{key}{getattr(kernel, field)}")
    return "-".join(parts)


def parse_method(spec: str, op: str | None = None) -> OverlapConfig:
    """'none', 'pipeline:4', 'ring', 'ring:2', 'ring-bidi', 'ring-bidi:2', 'ring-agg', 'auto',
    'fused' (RING_EXCHANGE with atomic_gemm: one kernel, Hopper GPUs; tilings as in
    `parse_fused`); a '-chain' suffix ('ring:4-chain') turns chain_gemms on, a '-mosaic' or
    '-xla' suffix last ('none-mosaic', 'ring:2-chain-xla') multiplies with the Hopper GEMM
    kernel or XLA's dot (local_gemm "mosaic" or "xla"; without one, "auto")."""
    if spec == "fused" or spec.startswith("fused-"):
        if op is None:
            raise ValueError(f"{spec!r}: a fused kernel spec needs the op (ag or rs)")
        return parse_fused(spec, op)
    full = spec
    local_gemm = "auto"
    for suffix in ("mosaic", "xla"):
        if spec.endswith(f"-{suffix}"):
            spec, local_gemm = spec[: -len(suffix) - 1], suffix
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
        return OverlapConfig(
            num_splits=num_splits, chain_gemms=chain, local_gemm=local_gemm, **table[name]
        )
    except ValueError as err:
        raise ValueError(f"method {full!r}: {err}") from None


def spec_of(cfg: OverlapConfig) -> str:
    """The method spec string (as `commgemm bench --methods` takes) of a config."""
    if cfg.atomic_gemm:
        return fused_spec(cfg)
    name = {Method.NONE: "none", Method.PIPELINE: "pipeline"}.get(cfg.method)
    if name is None:
        name = "ring-agg" if cfg.aggregate else "ring-bidi" if cfg.bidirectional else "ring"
    if cfg.num_splits > 1 and cfg.method is not Method.NONE:
        name = f"{name}:{cfg.num_splits}"
    name = f"{name}-chain" if cfg.chain_gemms else name
    return name if cfg.local_gemm == "auto" else f"{name}-{cfg.local_gemm}"
