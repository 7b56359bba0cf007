"""Time to quality: validation bits per byte after a fixed training-time budget, per corpus, budget and variant.

    python benchmarks/time_to_quality.py                     # TinyStories, 10 minutes
    python benchmarks/time_to_quality.py --corpus tinystories gutenberg --minutes 2 10
    python benchmarks/time_to_quality.py --corpus shakespeare --seconds 35 120 --seeds 3 --name time_to_quality_small
    python benchmarks/time_to_quality.py --quick             # 2 steps on TinyStories' validation text
    python benchmarks/time_to_quality.py --corpus gutenberg --minutes 2 \
        --variant adamw= --variant muon='optimizer:muon --schedule.peak-lr 0.02'

Each run is `minigpt train --preset cpu --max-time SECONDS FLAGS` in its own process, one after the other
(never two at once: they would share the cores), on the shared data folder's corpora: `tinystories` (the
train/valid slices), `gutenberg` (ten books, paragraphs as documents, 5% of them held out), `book` (one of
them, Pride and Prejudice) and `shakespeare` (Tiny Shakespeare, split 90/10 as nanoGPT does). Evaluation and
saving are outside the budget; the whole validation split is evaluated every `--eval-every` steps (250, for
the curve) and at the end. It prints a Markdown table, appends every result to
RUNS/results.jsonl (so runs of several invocations can be tabled together), plots the curves to
RUNS/time_to_quality.png and writes OUT/time_to_quality.json. `--src DIR` runs another checkout's code (e.g. a
`git worktree` of an older commit).

`--steps N` trains a fixed number of steps instead (the schedule follows them): quality after N steps does
not depend on the machine's speed, so two searches can run side by side, each pinned to one core:

    python benchmarks/time_to_quality.py --steps 280 --cores 0 --runs runs/a --variant x='--schedule.peak-lr 0.03' &
    python benchmarks/time_to_quality.py --steps 280 --cores 1 --runs runs/b --variant y='--schedule.peak-lr 0.01' &

or in one invocation, one run per core at once, in one record: `--steps 280 --cores 0,1 --parallel --variant
x=... --variant y=...`.

A variant that changes a step's cost must then be compared at the step count that takes the same time.
Each training splits the CPU into one XLA device per core it may use (`minigpt train`'s default,
`--mesh.cpu-devices -1`): a run pinned to one core trains on one device; `--variant one='--mesh.cpu-devices 1'`
trains an unpinned run on one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import REPO, SHARED, need, parser, print_tables, table, write_result

PRINTING = threading.Lock()
"""Parallel runs' threads print whole lines: print() writes a line and its newline in two calls."""

CORPORA = {
    "tinystories": ["--data", "{d}/tinystories/train.txt", "--val-data", "{d}/tinystories/valid.txt"],
    "gutenberg": ["--data", "{d}/gutenberg", "--data.separator", "blank-line"],
    # nanoGPT's split (its prepare.py): the first 90% of the characters train, the last 10% validate
    "shakespeare": ["--data", "{s}/train.txt", "--val-data", "{s}/val.txt", "--data.separator", "blank-line"],
    "book": ["--data", "{d}/gutenberg/1342-pride-and-prejudice.txt", "--data.separator", "blank-line"],
    # --quick: a corpus small enough that its tokenizer trains in a second
    "tinystories-valid": ["--data", "{d}/tinystories/valid.txt"],
}


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First training time at which bits per byte <= target, linearly interpolated between evaluations."""
    prev_t, prev_b = 0.0, float("inf")
    for t, b in curve:
        if b <= target:
            if prev_b == float("inf"):
                return t
            return prev_t + (t - prev_t) * (prev_b - target) / (prev_b - b)
        prev_t, prev_b = t, b
    return None


def shakespeare_split(args: argparse.Namespace) -> Path:
    """Tiny Shakespeare as nanoGPT splits it, written once into the runs folder (unchanged files are left
    alone, so their token store is reused)."""
    text = (Path(args.shared) / "tinyshakespeare" / "input.txt").read_text()
    folder, cut = Path(args.runs) / "tinyshakespeare-split", int(len(text) * 0.9)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.txt", text[:cut]), ("val.txt", text[cut:])):
        if not (folder / name).is_file() or (folder / name).read_text() != part:
            (folder / name).write_text(part)
    return folder


def corpus_flags(corpus: str, args: argparse.Namespace) -> list[str]:
    split = shakespeare_split(args) if corpus == "shakespeare" else ""
    return [f.format(d=args.shared, s=split) for f in CORPORA[corpus]]


def budgets(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, flags) per budget: minutes of training time, or a fixed number of steps (--steps), whose
    quality does not depend on the machine's speed, so variants can be compared while other work runs."""
    minutes = args.minutes or ([] if args.steps or args.seconds else [10.0])
    seconds = [(f"{s:g} s", s) for s in args.seconds] + [(f"{m:g} min", m * 60) for m in minutes]
    return [(label, ["--max-time", str(s)]) for label, s in seconds] + [
        (f"{n} steps", ["--steps", str(n), "--max-time", "0"]) for n in args.steps
    ]


def train_once(
    corpus: str,
    budget: tuple[str, list[str]],
    variant: str,
    flags: list[str],
    args: argparse.Namespace,
    seed: int = 0,
    cores: str = "",
) -> dict:
    """One run in a fresh process (pinned to `cores`, if given); its figures from the run's metrics.jsonl."""
    run_dir = (
        Path(args.runs) / f"{corpus}-{budget[0].replace(' ', '')}-{variant}{f'-seed{seed}' * bool(seed)}"
    )
    data = corpus_flags(corpus, args)
    cmd = [
        sys.executable,
        "-m",
        "minigpt.cli",
        "train",
        "--preset",
        args.preset,
        *data,
        "--run-dir",
        str(run_dir),
    ]
    cmd += ["--overwrite", *budget[1], "--eval-every", str(args.eval_every), "--ckpt-every", "0"]
    cmd += [*(["--seed", str(seed)] if seed else []), *flags]
    pin = ["taskset", "-c", cores] if cores else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    with PRINTING:
        print(f"$ {shlex.join([*pin, 'python', *cmd[1:]])}", flush=True)
    t0 = time.time()
    out = subprocess.run([*pin, *cmd], env=env, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{variant} on {corpus} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["kind"] == "val"]
    train = [r for r in rows if r["kind"] == "train"]
    return {
        "corpus": corpus,
        "budget": budget[0],
        "variant": variant,
        "seed": seed,
        "flags": shlex.join(flags),
        "src": args.src or "",
        "steps": val[-1]["step"],
        "train_s": train[-1]["elapsed_s"],
        "tokens_per_s": train[-1]["step"] * _tokens_per_step(run_dir) / train[-1]["elapsed_s"],
        "bpb": val[-1]["bpb"],
        "last_weights_bpb": last_weights(val[-1])["bpb"],
        "curve": [(r["elapsed_s"], r["bpb"]) for r in val],
        "started": t0,
        "wall_s": time.time() - t0,
        "sample": (run_dir / "samples.txt").read_text().split("--- step ")[-1].split("\n", 1)[1].strip(),
        "loss_png": str((run_dir / "loss.png").resolve()),
    }


def last_weights(val: dict) -> dict:
    """The evaluation of a run's last weights in its final validation row, which holds it under "last" where
    the run ended with other weights (its weight average, or the best it evaluated)."""
    while "last" in val:
        val = val["last"]
    return val


def _mean_and_spread(values: list[float]) -> str:
    spread = f" ± {(max(values) - min(values)) / 2:.4f}" * (len(values) > 1)
    return f"{sum(values) / len(values):.4f}{spread}"


def _tokens_per_step(run_dir: Path) -> int:
    cfg = json.loads((run_dir / "config.json").read_text())
    accum = cfg.get("grad_accum", 1)
    return cfg["batch_size"] * (accum if isinstance(accum, int) else 1) * cfg["data"]["seq_len"]


def results_table(results: list[dict]) -> dict:
    """One row per corpus, budget and variant: with several seeds, the mean and half the range."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["corpus"], r["budget"], r["variant"]), []).append(r)
    rows = []
    for (corpus, budget, variant), runs in groups.items():
        steps = "/".join(str(r["steps"]) for r in runs)
        speed = f"{sum(r['tokens_per_s'] for r in runs) / len(runs):,.0f}"
        last = _mean_and_spread([r.get("last_weights_bpb", r["bpb"]) for r in runs])
        bpb = _mean_and_spread([r["bpb"] for r in runs])
        rows.append([corpus, budget, variant, len(runs), steps, speed, last, bpb])
    columns = [
        "corpus",
        "budget",
        "variant",
        "seeds",
        "steps",
        "tokens/s",
        "last weights' val bits/byte",
        "val bits/byte (mean ± half range)",
    ]
    samples = " ".join(
        f'Sample ({r["corpus"]}, {r["budget"]}, {r["variant"]}): "{r["sample"][:200]}"'
        for r in results
        if not r.get("seed")
    )
    return table(columns, rows, note=samples)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = sorted({r["corpus"] for r in results})
    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4), squeeze=False)
    for ax, corpus in zip(axes[0], corpora, strict=True):
        for r in (r for r in results if r["corpus"] == corpus):
            ts, bs = zip(*r["curve"], strict=True)
            ax.plot([t / 60 for t in ts], bs, "o-", label=f"{r['variant']}, {r['budget']}")
        ax.set(xlabel="training time (minutes)", ylabel="validation bits per byte", title=corpus)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant takes NAME=FLAGS (FLAGS may be empty), got {text!r}")
    return name, shlex.split(flags)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--corpus", nargs="+", default=["tinystories"], choices=sorted(CORPORA))
    p.add_argument("--minutes", nargs="+", type=float, default=[], help="training-time budgets (10)")
    p.add_argument("--seconds", nargs="+", type=float, default=[], help="training-time budgets in seconds")
    p.add_argument("--steps", nargs="+", type=int, default=[], help="fixed-step budgets instead")
    p.add_argument("--seeds", type=int, default=1, help="runs per corpus, budget and variant (--seed 0..N-1)")
    p.add_argument("--cores", default="", help="pin each run to these cores (taskset -c), e.g. 0 or 0,1")
    p.add_argument(
        "--parallel",
        action="store_true",
        help="with --steps: one run on each of --cores at once, each pinned to it",
    )
    p.add_argument("--variant", action="append", default=[], help="NAME=FLAGS for minigpt train (repeat)")
    p.add_argument("--preset", default="cpu")
    p.add_argument("--shared", default=str(SHARED), help="the shared data folder")
    p.add_argument("--name", default="time_to_quality", help="the record's name (OUT/NAME.json)")
    p.add_argument("--src", default="", help="run this source folder's minigpt instead (PYTHONPATH)")
    p.add_argument("--runs", default="runs/time_to_quality", help="folder for the training runs")
    p.add_argument(
        "--eval-every", type=int, default=250, help="validation every N steps, for the curve (0: end)"
    )
    args = p.parse_args()
    if args.quick:  # its runs go with its JSON, not into the folder of real ones
        args.corpus, args.minutes, args.steps = ["tinystories-valid"], [], [2]
        args.runs = str(Path(args.out) / "time_to_quality_runs")
    if args.parallel and (args.minutes or args.seconds or not args.steps or "," not in args.cores):
        p.error(
            "--parallel takes --steps (timed runs would share the machine) and two or more --cores, e.g. 0,1"
        )
    return args


def run_all(jobs: list[tuple], args: argparse.Namespace) -> list[dict]:
    """Every (corpus, budget, (variant, flags), seed) run, in order; with --parallel, one per core at once."""
    free: queue.Queue[str] = queue.Queue()
    for core in args.cores.split(",") if args.parallel else [args.cores]:
        free.put(core)

    def one(job: tuple) -> dict:
        corpus, budget, (name, flags), seed = job
        core = free.get()
        try:
            r = train_once(corpus, budget, name, flags, args, seed, core)
        finally:
            free.put(core)
        with PRINTING:
            print(
                f"{corpus} {budget[0]} {name} seed {seed}: step {r['steps']}, val bits/byte {r['bpb']:.4f}",
                flush=True,
            )
            with open(Path(args.runs) / "results.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
        return r

    with concurrent.futures.ThreadPoolExecutor(free.qsize()) as pool:
        return list(pool.map(one, jobs))


def main() -> None:
    args = parse_args()
    shakespeare = [Path(args.shared) / "tinyshakespeare" / "input.txt"] * ("shakespeare" in args.corpus)
    need(
        *shakespeare,
        *(Path(f.format(d=args.shared, s="")) for c in args.corpus for f in CORPORA[c] if "{d}" in f),
    )
    variants = [parse_variant(v) for v in args.variant] or [("default", [])]
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    jobs = list(itertools.product(args.corpus, budgets(args), variants, range(args.seeds)))
    results = run_all(jobs, args)
    tables = [results_table(results)]
    print_tables(tables)
    plot(results, Path(args.runs) / "time_to_quality.png")
    flags = {name: shlex.join(f) for name, f in variants}
    headlines = [
        (f"With `{flags[row[2]]}`, the" if flags.get(row[2]) else "The")
        + f" {args.preset} preset reaches {row[-1]} bits per byte on {row[0]} after {row[1]} of training "
        f"({row[4]} steps at {row[5]} tokens/s{f', {row[3]} seeds' if int(row[3]) > 1 else ''})"
        for row in tables[0]["rows"]
    ]
    longest = max(results, key=lambda r: r["train_s"])  # the README's picture: the longest training
    data = {"results": results, "loss_png": longest["loss_png"]}
    named = [*args.corpus, *(f"{n} steps" for n in args.steps if not args.quick)]  # fixed steps: not timed
    title = "Time to quality" + ("" if args.name == "time_to_quality" else f" ({', '.join(named)})")
    write_result(args, args.name, title, tables, headlines=headlines, data=data)


if __name__ == "__main__":
    main()
