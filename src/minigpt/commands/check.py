"""`minigpt check RUN` (or --run-dir RUN): one line per problem and what to do, then a summary; exit 1 unless
everything verifies."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from minigpt.config import ConfigError


def parse(args: list[str]) -> str | None:
    """The run directory to check; None for --help."""
    if args in (["-h"], ["--help"]):
        return None
    if len(args) == 2 and args[0] in ("--run", "--run-dir"):
        args = args[1:]
    if len(args) != 1 or args[0].startswith("-"):
        raise ConfigError("usage: minigpt check RUN (a run directory written by `minigpt train`)")
    return args[0]


def load() -> Callable[[str | None], None]:
    from minigpt.app import check

    def run(run_dir: str | None) -> None:
        if run_dir is None:
            print(f"usage: minigpt check RUN\n\n{check.__doc__}")
            return
        found = check.check_run(run_dir)
        for line in found.notes:
            print(f"note: {line}")
        for line in found.problems:
            print(f"problem: {line}")
        print(found.summary(Path(run_dir)))
        if found.problems:
            sys.exit(1)

    return run
