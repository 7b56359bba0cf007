"""Run benchmarks and render docs/results.md from their JSON.

    python -m benchmarks [--quick] [--out DIR] [--write-docs] [NAMES...]

Each benchmark runs in its own process and writes NAME.json into --out. A full run runs them one after the
other (two at once would share the cores and disturb each other's timings); a --quick run, whose timings mean
nothing, two at a time. A full run (the default) writes into benchmarks/results/, then rewrites
docs/results.md from every JSON there (a benchmark not rerun keeps its last tables), the README's block
between its results markers, and docs/img/loss.png from the time_to_quality run. A --quick run writes into a
temporary folder and leaves the docs alone unless --write-docs asks. Exit status 1 if any benchmark failed;
a benchmark whose data is absent is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import BENCHMARKS
from benchmarks.common import REPO, RESULTS, SKIPPED
from benchmarks.report import RESULTS_PAGE, figure, load, readme_block, render, update_readme
from minigpt.runtime import files


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}"
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes, a step or two each (into a temporary folder)"
    )
    p.add_argument(
        "--out", help="folder for the JSON (default: benchmarks/results; --quick: a temporary one)"
    )
    p.add_argument("--jobs", type=int, help="benchmarks at once (default: 1; --quick: 2)")
    p.add_argument("--write-docs", action="store_true", help="rewrite the docs after a --quick run too")
    p.add_argument(
        "--render-only", action="store_true", help="run nothing: render the docs from the JSON present"
    )
    p.add_argument("--docs", type=Path, default=REPO / RESULTS_PAGE, help=argparse.SUPPRESS)
    p.add_argument("--readme", type=Path, default=REPO / "README.md", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    return args


def run_one(name: str, quick: bool, out: Path) -> str:
    """Run benchmarks/NAME.py, its output into OUT/NAME.log; 'ok', 'skipped: why' or 'FAILED ...'."""
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / f"{name}.py"),
        *(["--quick"] if quick else []),
        "--out",
        str(out),
    ]
    log = out / f"{name}.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    if code == SKIPPED:
        return next((line for line in text.splitlines() if line.startswith("skipped: ")), "skipped")
    if code:
        return f"FAILED (exit status {code}); the end of {log}:\n" + "\n".join(text.splitlines()[-25:])
    return "ok"


def timed_run(name: str, quick: bool, out: Path) -> tuple[str, float]:
    t = time.perf_counter()
    return run_one(name, quick, out), time.perf_counter() - t


def write_docs(folders: list[Path], docs: Path, readme: Path) -> None:
    """docs/results.md from the records of `folders` (later ones win), the README's block, the loss plot."""
    records = load(folders)
    docs.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(docs, render(records))
    print(f"wrote {docs} ({len(records)} benchmarks)")
    page = docs.relative_to(readme.parent) if docs.is_relative_to(readme.parent) else docs
    if not readme.is_file() or not update_readme(readme, readme_block(records, str(page))):
        print(
            f"note: {readme} has no <!-- results:begin --> / <!-- results:end --> markers; its block is unchanged"
        )
    else:
        print(f"updated the results block of {readme}")
    pictures = {name: figure(r) for name, r in records.items()}
    pictures["loss"] = (records.get("time_to_quality", {}).get("data") or {}).get("loss_png")
    for name, png in pictures.items():
        if png and Path(png).is_file():
            (docs.parent / "img").mkdir(exist_ok=True)
            shutil.copyfile(png, docs.parent / "img" / f"{name}.png")
            print(f"copied {png} to {docs.parent / 'img' / f'{name}.png'}")


def main() -> None:
    args = parse_args()
    out = (
        Path(args.out)
        if args.out
        else (Path(tempfile.mkdtemp(prefix="minigpt-bench-")) if args.quick else RESULTS)
    )
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.render_only:
        names = args.names or BENCHMARKS
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.jobs or (2 if args.quick else 1)) as pool:
            runs = {pool.submit(timed_run, name, args.quick, out): name for name in names}
            for done in concurrent.futures.as_completed(runs):
                status, seconds = done.result()
                print(f"{runs[done]}: {status} ({seconds:.0f} s)", flush=True)
                if status.startswith("FAILED"):
                    failed.append(runs[done])
        print(
            f"{len(names)} benchmarks in {time.perf_counter() - t0:.0f} s; JSON and logs in {out}", flush=True
        )
    if args.render_only or args.write_docs or not args.quick:
        write_docs(
            [RESULTS, out] if out.resolve() != RESULTS.resolve() else [RESULTS], args.docs, args.readme
        )
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
