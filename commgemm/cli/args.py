"""Argument types for the CLI: every value checked by argparse, so a bad flag is a one-line
error before anything runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable

#: commgemm.bench.PRESETS' names (that module imports jax, which must wait for device setup).
PRESET_NAMES = ("llama70b_mlp", "llama8b_mlp", "comm_heavy", "llama13b_mlp", "notebook")
#: The dtypes the demo, bench and tune run, by their canonical names; short aliases (bf16,
#: f32) are accepted as everywhere in commgemm.
DTYPES = ("bfloat16", "float32", "float16")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default shown once: not where the help names its own, nor a None default (an
    option that is off, or required)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.required:
            return text
        return super()._get_help_string(action)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def dtype(text: str) -> str:
    """A dtype of DTYPES, by name or alias."""
    from commgemm.config import dtype_name

    try:
        name = dtype_name(text)
    except ValueError:
        name = None
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose from {', '.join(DTYPES)} (or bf16, f32)"
        )
    return name


def shape(text: str) -> tuple[int, int, int]:
    """M,K,N: three positive integers."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be M,K,N (three positive integers)")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def methods(text: str) -> list[str]:
    """A comma-separated list of method specs (`commgemm.cli.specs`), each checked."""
    from commgemm.cli.specs import parse_method

    out = [m.strip() for m in text.split(",") if m.strip()]
    if not out:
        raise argparse.ArgumentTypeError("no method given")
    for spec in out:
        errors = []
        for op in ("ag", "rs"):  # the op, which picks a fused kernel's family, comes later
            try:
                parse_method(spec, op)
                break
            except ValueError as err:
                errors.append(str(err))
        else:
            raise argparse.ArgumentTypeError(errors[-1])
    return out
