"""What the benchmarks that measure each configuration in its own process share: a child reports its
measurements (with its peak resident memory, which is why it runs alone) on one stdout line the parent finds,
and results record the code they measured."""

from __future__ import annotations

import json
import resource
import subprocess
from pathlib import Path

RESULT = "RESULT "  # the line a child prints its measurements on


def report(measurements: dict) -> None:
    """Print a child's measurements, with this process's peak resident memory, for `read_result`."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(RESULT + json.dumps({**measurements, "peak_rss_bytes": rss}), flush=True)


def read_result(stdout: str) -> dict | None:
    """The measurements a child printed with `report`, or None if it printed none."""
    line = next((s for s in stdout.splitlines() if s.startswith(RESULT)), None)
    return None if line is None else json.loads(line[len(RESULT) :])


def code_version() -> dict:
    """The commit measured, and any files under src/ that differ from it (uncommitted work)."""
    root = Path(__file__).resolve().parents[1]
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()
    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--porcelain", "src").splitlines(),
        }
    except OSError:
        return {}


def describe(code: dict) -> str:
    """'minigpt 6e8fc84 (+ uncommitted src/minigpt/loss.py)'."""
    if not code.get("commit"):
        return "minigpt (no git)"
    changed = [line.split()[-1] for line in code["modified"]]
    return f"minigpt {code['commit'][:7]}" + (f" (+ uncommitted {', '.join(changed)})" if changed else "")
