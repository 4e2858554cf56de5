"""Progress for the CLI's long commands: a rich bar on a terminal, a line per step elsewhere
(a log or a pipe, where a bar would print nothing until the end)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def steps(
    console, command: str, *, total: int | None = None, lead: bool = True
) -> Iterator[Callable[[str], None]]:
    """A `step(name)` callback for `command`'s steps: advances a transient bar when stderr
    is a terminal, else prints `command: name` to stderr; only on the lead process."""
    from rich.progress import Progress

    terminal = sys.stderr.isatty()
    with Progress(console=console, transient=True, disable=not (lead and terminal)) as bar:
        task = bar.add_task(command, total=total)

        def step(name: str) -> None:
            bar.update(task, advance=1, description=f"{command} {name}")
            if lead and not terminal:
                print(f"{command}: {name}", file=sys.stderr, flush=True)

        yield step
