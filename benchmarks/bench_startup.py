"""How long commands take to start: from a cold compilation cache (an empty folder) and a warm one (the same
command again), and the default main job's time to its first step.

    python benchmarks/bench_startup.py                    # cpu and tutorial presets; main job on 500 MB
    python benchmarks/bench_startup.py --presets cpu --big-mb 100
    python benchmarks/bench_startup.py --quick            # a tiny model and corpus: checks that it runs

Per preset, on the shared TinyStories slice (tokenized first, outside the timings), each command runs in
its own process as a user runs it: `minigpt train` from the command to its first step's log line (cold: a
new run of --steps steps; warm: resuming it for as many more), `minigpt generate` of 50 tokens from that
run, and `minigpt eval` of it. Each command's cold call gets a new, empty --compile-cache folder and its warm
call the same folder again, --repeats times (the medians are reported); the measured CPU peak is shared
(measured until settled, first), so cold and warm differ only in the compilation cache. Then the default main
job, `minigpt train --preset cpu`, on a corpus already on disk (the slice repeated to --big-mb MB) with
nothing cached (a new user's first command), from the command to its first step, the median of --repeats
runs. Every cache is a temporary folder: the user's own are never read or written.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, SHARED, need, parser, print_tables, table, write_result

SLICE, VALID, GPT2 = (
    SHARED / "tinystories" / "train.txt",
    SHARED / "tinystories" / "valid.txt",
    SHARED / "gpt2",
)
STEP = re.compile(r"^step\s+\d+(/\d+)? \| loss")  # a training step's log line
TINY_DATA = ["--data.seq-len", "16", "--data.bpe-vocab-size", "300"]  # --quick: a tiny BPE and model
TINY_MODEL = ["--model.d-model", "32", "--model.n-heads", "4", "--model.n-layers", "1", "--model.d-ff", "64",
              "--model.max-seq-len", "32", "--batch-size", "4"]  # fmt: skip


def minigpt(args: list[str], cache_root: Path, first_step_only: bool = False) -> dict[str, float | None]:
    """Run `minigpt ARGS` with MINIGPT_CACHE_DIR=cache_root: its wall seconds, the seconds to its first
    training step's log line (None if it logs none) and its CPU seconds (user + system, which other work on
    a shared machine disturbs less than wall time). `first_step_only` stops it there."""
    env = {**os.environ, "MINIGPT_CACHE_DIR": str(cache_root), "PYTHONUNBUFFERED": "1"}
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(name, None)  # the benchmark's own folders, not whatever this shell points JAX at
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # minigpt's modules load from cached bytecode, as for a user
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "minigpt.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True)  # fmt: skip
    first, lines = None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if first is None and STEP.match(line):
            first = time.perf_counter() - t0
            if first_step_only:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: tokenizer workers too
                break
    _, status, usage = os.wait4(proc.pid, 0)
    wall, proc.returncode = time.perf_counter() - t0, os.waitstatus_to_exitcode(status)
    if proc.returncode and not (first_step_only and first is not None):
        sys.exit(f"minigpt {' '.join(args)} failed (exit status {proc.returncode}):\n{''.join(lines[-30:])}")
    return {"wall_s": wall, "first_step_s": first, "cpu_s": usage.ru_utime + usage.ru_stime}


def pairs(preset: str, root: Path, args) -> list[dict]:
    """Cold and warm calls of train (to its first step; resumed when warm), generate and eval for `preset`."""
    extra = TINY_DATA if args.quick else []
    extra += ["--data.gpt2-dir", str(GPT2)] if preset == "tutorial" else []
    data = ["--preset", preset, "--data", str(args.slice), "--val-data", str(VALID),
            "--data.cache-dir", str(root / "tokens"), *extra]  # fmt: skip
    if not args.quick:  # the store is built outside the timings (--quick: by the cold train, saving a run)
        minigpt(["prepare", *data], root)
    run = root / f"run-{preset}"  # the first repeat's train makes it; generate and eval read it
    train = [*data, *(TINY_MODEL if args.quick else []), "--max-time", "0", "--log-every", "1", "--eval-every",
             "1000000", "--eval-batches", "1", "--ckpt-every", "0", "--sample-tokens", "0"]  # fmt: skip
    evals = ["--batches", str(args.eval_batches)]
    generate = ["generate", "--run", str(run), "--prompt", "Once upon a time", "--max-new-tokens",
                str(args.new_tokens)]  # fmt: skip
    calls = {
        "train: command to first step": lambda i, r: ["train", *train, "--run-dir", f"{run}{'-' * r}{r or ''}",
                                                      "--steps", str(args.steps * (i + 1))],
        f"generate {args.new_tokens} tokens": lambda i, r: generate,
        f"generate {args.new_tokens} tokens --no-stream": lambda i, r: [*generate, "--no-stream"],
        "eval": lambda i, r: ["eval", "--run", str(run), *evals],
    }  # fmt: skip
    out = []
    for what, argv in calls.items():
        key = "first_step_s" if what.startswith("train") else "wall_s"
        times = []  # (cold, warm) per repeat, each pair with a new, empty cache folder
        for r in range(args.repeats):
            cache = root / f"xla-{preset}-{len(out)}-{r}"
            times.append([minigpt([*argv(i, r), "--compile-cache", str(cache)], root) for i in range(2)])
        cold, warm = (
            {k: _median(times, i, k) for k in ("wall_s", "first_step_s", "cpu_s")} for i in range(2)
        )
        out.append({"preset": preset, "command": what, "cold_s": cold[key], "warm_s": warm[key],
                    "cold_wall_s": cold["wall_s"], "warm_wall_s": warm["wall_s"], "cold_cpu_s": cold["cpu_s"],
                    "warm_cpu_s": warm["cpu_s"], "repeats": times})  # fmt: skip
        print(f"{preset} | {what} | cold {cold[key]:.1f} s | warm {warm[key]:.1f} s (medians of {args.repeats})",
              flush=True)  # fmt: skip
    return out


def _median(times: list[list[dict]], i: int, key: str) -> float | None:
    """The median over repeats of call i's (0 cold, 1 warm) `key` (None where a call has none)."""
    values = [t[i][key] for t in times]
    return None if None in values else statistics.median(values)


def main_job(root: Path, args) -> dict:
    """`minigpt train --preset cpu` on a --big-mb MB corpus on disk, to its first step, with nothing cached:
    the median of --repeats runs, each in new folders."""
    big = root / "big.txt"
    text = args.slice.read_bytes()
    with open(big, "wb") as f:
        while f.tell() < args.big_mb * 1e6:
            f.write(text)
        os.fsync(f.fileno())  # a user's corpus is on disk already: writing it out is not the command's time
    size, firsts = big.stat().st_size, []
    for r in range(args.repeats):
        fresh = root / f"new-user-{r}"
        argv = ["train", "--preset", "cpu", "--data", str(big), "--val-data", str(VALID), "--run-dir",
                str(fresh / "run"), "--data.cache-dir", str(fresh / "tokens"), *(TINY_DATA + TINY_MODEL if args.quick else [])]  # fmt: skip
        firsts.append(minigpt(argv, fresh / "cache", first_step_only=True)["first_step_s"])
        shutil.rmtree(fresh)
    big.unlink()
    first = statistics.median(firsts)
    print(f"main job: first step {first:.1f} s after the command ({size / 1e6:,.0f} MB; median of {len(firsts)}, "
          f"{min(firsts):.1f}-{max(firsts):.1f} s)")  # fmt: skip
    return {"corpus_mb": size / 1e6, "first_step_s": first, "runs_s": firsts}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--presets", nargs="+", default=["cpu", "tutorial"], choices=["cpu", "tutorial"])
    p.add_argument(
        "--steps", type=int, default=3, help="steps of the cold run; the warm one resumes for more"
    )
    p.add_argument("--new-tokens", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5, help="cold/warm pairs per command; medians are reported")
    p.add_argument("--eval-batches", type=int, default=0, help="validation batches of eval (0: all)")
    p.add_argument("--big-mb", type=float, default=500, help="size of the main job's corpus, MB")
    args = p.parse_args()
    need(SLICE, VALID, *([GPT2] if "tutorial" in args.presets else []))
    args.slice = SLICE
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-startup-") as tmp:
        root = Path(tmp)
        if args.quick:
            args.presets, args.steps, args.new_tokens, args.eval_batches, args.big_mb = ["cpu"], 1, 8, 2, 0.5
            args.repeats = 1
            args.slice = root / "slice.txt"  # a small corpus: a tiny BPE trains in a moment
            args.slice.write_bytes(SLICE.read_bytes()[:300_000])
        measure_peak(root)
        rows = [r for preset in args.presets for r in pairs(preset, root, args)]
        job = main_job(root, args)
    write(args, rows, job)


def measure_peak(root: Path) -> None:
    """The CPU probe (the peak `train` divides MFU by, the dtype auto picks), measured into the benchmark's
    cache folder until settled before any timing, so no timed call measures it and all read it."""
    os.environ["MINIGPT_CACHE_DIR"] = str(root)
    from minigpt.training.hardware import settle_probe

    settle_probe()


def write(args, rows: list[dict], job: dict) -> None:
    cells = [[r["preset"], r["command"], f"{r['cold_s']:.1f}", f"{r['warm_s']:.1f}",
              f"{r['warm_s'] / r['cold_s']:.2f}x", f"{r['cold_cpu_s']:.1f}", f"{r['warm_cpu_s']:.1f}"]
             for r in rows]  # fmt: skip
    n = len(job["runs_s"])
    runs = f"The median of {n} runs, each" if n > 1 else "One run,"
    job_row = ["minigpt train --preset cpu", f"{job['corpus_mb']:,.0f} MB", f"{job['first_step_s']:.1f}",
               f"{min(job['runs_s']):.1f}", f"{max(job['runs_s']):.1f}"]  # fmt: skip
    tables = [
        table(
            ["preset", "command", "cold cache s", "warm cache s", "warm / cold", "cold CPU s", "warm CPU s"],
            cells,
            title="Cold and warm compilation cache",
            note="Each command from its start: train to its first "
            f"step's log line (cold: a new run of {args.steps} steps; warm: resuming it), generate and eval "
            "to their end. Cold: an empty --compile-cache folder; warm: the same command again. CPU s: the "
            f"whole command's user + system time. Medians of {args.repeats} cold/warm pairs, each with a new "
            "cache folder.",
        ),
        table(
            ["command", "corpus on disk", "first step s", "fastest s", "slowest s"],
            [job_row],
            title="The default main job",
            note="Nothing cached: no token store, no compiled programs, no measured CPU peak (a new user's first "
            f"command); TinyStories' text repeated to the size shown. {runs} in new folders.",
        ),
    ]
    print_tables(tables)
    cpu = {r["command"].split()[0] + (" no-stream" if "no-stream" in r["command"] else ""): r
           for r in rows if r["preset"] == "cpu"}  # fmt: skip
    ratio = lambda r: f"{r['warm_s']:.1f} s warm, {r['warm_s'] / r['cold_s']:.2f}x cold"
    headlines = [f"`minigpt train --preset cpu` with a {job['corpus_mb']:,.0f} MB corpus on disk logs its first "
                 f"step {job['first_step_s']:.0f} s after the command"]  # fmt: skip
    if cpu:
        headlines.append(
            f"Compilation cache, cpu preset: a resumed run's first step {ratio(cpu['train:'])}; `generate` of "
            f"{args.new_tokens} tokens {ratio(cpu['generate'])} (with --no-stream {ratio(cpu['generate no-stream'])})"
        )
    write_result(args, "bench_startup", "Startup: cold and warm compilation cache", tables, headlines=headlines,
                 data={"pairs": rows, "main_job": job})  # fmt: skip


if __name__ == "__main__":
    main()
