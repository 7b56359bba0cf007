"""What every benchmark shares: its two standard flags (--quick, --out), the JSON record it writes (which the
runner, `python -m benchmarks`, renders into docs/results.md), the machine and code it measured, and the
result line a child process reports its measurements on.

A benchmark runs as a script (`python benchmarks/NAME.py`), so this module is imported as `common` there and
as `benchmarks.common` by the runner; it imports nothing from either name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
SHARED_VARIABLE = "MINIGPT_SHARED_DATA"
SHARED = Path(os.environ.get(SHARED_VARIABLE) or REPO.parent / "shared" / "data")
"""The shared data folder of real text: $MINIGPT_SHARED_DATA, else `shared/data` beside the clone."""
RESULTS = REPO / "benchmarks" / "results"
SKIPPED = 75  # a benchmark's exit status when its data is absent: the runner says so and keeps its last JSON
RESULT = "RESULT "  # the line a child prints its measurements on


# ------------------------------------------------------------------------------------------------ flags


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes: --quick and --out."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes and a step or two: checks the benchmark runs"
    )
    p.add_argument("--out", default=str(RESULTS), help="folder for NAME.json (default: benchmarks/results)")
    p.add_argument(
        "--machine-tag",
        default="",
        type=machine_tag,
        help="a second machine's record beside the first (e.g. avx2): NAME_TAG.json, its title and headlines "
        "naming this CPU",
    )
    return p


def machine_tag(tag: str) -> str:
    """A tag goes into a file name and a page anchor, so it is letters, digits and '-' only."""
    if not re.fullmatch(r"[A-Za-z0-9-]*", tag):
        raise argparse.ArgumentTypeError(f"{tag!r} must be letters, digits or '-' (it names NAME_TAG.json)")
    return tag


def skip(reason: str) -> NoReturn:
    print(f"skipped: {reason}", flush=True)
    sys.exit(SKIPPED)


def need(*paths: Path) -> None:
    """Skip the benchmark (exit SKIPPED) unless every path exists."""
    for path in paths:
        if not Path(path).exists():
            skip(
                f"{path} is absent: set ${SHARED_VARIABLE} to the shared data folder (docs/data.md says what it "
                "holds and how to get TinyStories)"
            )


# ------------------------------------------------------------------------------------------------ provenance


def machine() -> dict[str, Any]:
    """The machine a result was measured on: CPU model, cores this process may use, memory, accelerator."""
    import jax

    from minigpt.training.hardware import cpu_model

    try:
        kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        )
    except (OSError, StopIteration):
        kib = 0
    devices = jax.devices()
    accelerator = "none" if devices[0].platform == "cpu" else f"{len(devices)} x {devices[0].device_kind}"
    return {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(kib / 2**20, 1),
        "accelerator": accelerator,
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def describe_machine(m: dict[str, Any]) -> str:
    """'Intel Xeon, 2 cores, 23.5 GiB, no accelerator'."""
    acc = "no accelerator" if m.get("accelerator") in (None, "none") else m["accelerator"]
    return f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, {acc}"


def code_version() -> dict[str, Any]:
    """The commit measured, and any files under src/ that differ from it (uncommitted work)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--porcelain", "src").splitlines(),
        }
    except OSError:
        return {}


def describe_code(code: dict[str, Any]) -> str:
    """'minigpt 6e8fc84 (+ uncommitted src/minigpt/loss.py)'."""
    if not code.get("commit"):
        return "minigpt (no git)"
    changed = [line.split()[-1] for line in code.get("modified", [])]
    return f"minigpt {code['commit'][:7]}" + (f" (+ uncommitted {', '.join(changed)})" if changed else "")


def command() -> str:
    """This process's command line as one would type it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    args = [os.path.relpath(a, REPO) if a.startswith(str(REPO)) else a for a in sys.argv[1:]]
    return shlex.join(["python", str(shown), *args])


# ------------------------------------------------------------------------------------------------ records


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "", note: str = "") -> dict:
    """A table of a record: column headers and rows of cells, formatted as they are to be shown."""
    return {
        "title": title,
        "columns": list(columns),
        "rows": [[str(c) for c in r] for r in rows],
        "note": note,
    }


def record_tag(tag: str, measured_on: dict[str, Any]) -> str:
    """The machine tag of a record: the one asked for, else on an accelerator its kind ('tpu-v5-lite'), so
    that a benchmark run on a TPU or GPU never writes over the CPU's record of the same name."""
    if tag or measured_on.get("accelerator", "none") == "none":
        return tag
    return re.sub(r"[^a-z0-9]+", "-", measured_on["accelerator"].split(" x ", 1)[-1].lower()).strip("-")


def write_result(
    args: argparse.Namespace,
    name: str,
    title: str,
    tables: Sequence[dict],
    *,
    headlines: Sequence[str] = (),
    data: Any = None,
    code: dict[str, Any] | None = None,
) -> Path:
    """OUT/NAME.json: the tables and headline figures the results page shows, with what was measured where and
    how (commit, date, machine, command), and the raw measurements (`data`). Written atomically."""
    from minigpt.runtime import files

    measured_on = machine()
    if tag := record_tag(getattr(args, "machine_tag", ""), measured_on):
        accelerator = measured_on.get("accelerator", "none") != "none"
        where = f" on {measured_on['accelerator'] if accelerator else measured_on['cpu']} ({tag})"
        name, title, headlines = f"{name}_{tag}", title + where, [h + where for h in headlines]
    record = {
        "name": name,
        "title": title,
        "quick": bool(args.quick),
        "code": code or code_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": measured_on,
        "command": command(),
        "tables": list(tables),
        "headlines": list(headlines),
        "data": data,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    files.write_json(path, record)
    print(f"\nwrote {path}", flush=True)
    return path


def markdown(t: dict) -> str:
    """A table of a record as Markdown: text columns left-aligned, the others (numbers) right-aligned."""
    cols, rows = t["columns"], t["rows"]
    numeric = [bool(rows) and all(_numeric(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _numeric(cell: str) -> bool:
    """A number, with or without a unit after it ('1.2M', '12 MiB', '2.3x'), or an empty cell."""
    return re.match(r"^[-+]?[\d,]*\.?\d+\b|^[-+]?\d", cell.strip()) is not None or cell.strip() in (
        "",
        "-",
        "n/a",
    )


def print_tables(tables: Sequence[dict]) -> None:
    for t in tables:
        print(
            ("\n" + t["title"] + "\n" if t["title"] else "\n")
            + markdown(t)
            + ("\n" + t["note"] if t["note"] else "")
        )


# ------------------------------------------------------------------------------------------------ children


def report(measurements: dict) -> None:
    """Print a child's measurements, with this process's peak resident memory, for `run_child`."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(RESULT + json.dumps({**measurements, "peak_rss_bytes": rss}), flush=True)


def read_result(stdout: str) -> dict | None:
    """The measurements a child printed with `report`, or None if it printed none."""
    line = next((s for s in stdout.splitlines() if s.startswith(RESULT)), None)
    return None if line is None else json.loads(line[len(RESULT) :])


def run_child(argv: Sequence[str]) -> tuple[dict | None, str]:
    """Run `python ARGV` in a fresh process (its peak memory is then its own): its measurements, or None and
    why not."""
    proc = subprocess.run([sys.executable, *argv], stdout=subprocess.PIPE, text=True)
    result = read_result(proc.stdout)
    if proc.returncode or result is None:
        why = f"exit status {proc.returncode}" + (" (killed: out of memory?)" if proc.returncode < 0 else "")
        return None, f"{why}\n{proc.stdout[-2000:]}"
    return result, ""
