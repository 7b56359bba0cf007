"""`minigpt check RUN` (or --run-dir RUN): one line per problem and what to do, then a summary; exit 1 unless
everything verifies."""

from __future__ import annotations

import sys
from pathlib import Path

from minigpt.config import ConfigError


def main(args: list[str]) -> None:
    from minigpt.app import check

    if args in (["-h"], ["--help"]):
        print(f"usage: minigpt check RUN\n\n{check.__doc__}")
        return
    if len(args) == 2 and args[0] in ("--run", "--run-dir"):
        args = args[1:]
    if len(args) != 1 or args[0].startswith("-"):
        raise ConfigError("usage: minigpt check RUN (a run directory written by `minigpt train`)")
    found = check.check_run(args[0])
    for line in found.notes:
        print(f"note: {line}")
    for line in found.problems:
        print(f"problem: {line}")
    print(found.summary(Path(args[0])))
    if found.problems:
        sys.exit(1)
