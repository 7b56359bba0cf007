"""Mixed precision against float32 at equal steps: the same run, step for step, with `--model.dtype auto`
(bfloat16 products with float32 accumulation where this machine has the matrix units for it) and with
`--model.dtype float32`, on real text, compared by validation bits per byte and by their loss curves.

    python benchmarks/bench_precision.py                   # cpu: 300 steps; tutorial (batch 16): 400, 3 seeds
    python benchmarks/bench_precision.py --presets cpu --steps cpu=150
    python benchmarks/bench_precision.py --seeds tutorial=1  # the tutorial with seed 0 alone
    python benchmarks/bench_precision.py --quick            # a few steps of a small model

Each run is `minigpt train --preset P --steps N --max-time 0` in its own process, one after the other, on the
shared data folder's TinyStories (train and validation slices), with the same seed, data order and schedule;
the whole validation split is evaluated at the end. The tutorial preset trains at batch 16 (its own is 144,
hours on a CPU); its dropout draws the same masks in both runs. Its loss sits on a plateau for the first
50-110 steps, and when a run leaves it decides where the run is hundreds of steps later, by more than the
dtypes differ: so each dtype runs with several seeds (the seed sets the initial weights, the data order
and the dropout masks) and the means are compared, beside float32's own spread across seeds. Target: the
means' bits per byte within 0.5% of each other. The plot puts every run's training loss on one figure per
preset.

A second measurement takes the plateau out: each float32 run saves its state halfway, and a copy of it
resumes from there in auto (`dtype` may change on resume; everything else, the data order and dropout
masks included, is the same), so two runs from one state differ only in the dtype of their second half.
Its gap is the dtype's own effect on learning; the first table's also holds where each run left the plateau.
`--control` trains float32 once more per seed with the output layer's gradients summed in another order
(`--model.loss-chunk 8`): how far a last-bit difference alone moves a run from scratch.

    python benchmarks/bench_precision.py --presets tutorial --seeds tutorial=1 --control
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from common import REPO, SHARED, code_version, need, parser, print_tables, table, write_result

DEFAULTS = {
    "cpu": {"steps": 300, "batch": 48, "seeds": 1},
    "tutorial": {"steps": 400, "batch": 16, "seeds": 3},
}
DTYPES = ("float32", "auto")
CONTROL = ["--model.loss-chunk", "8"]
"""The control's perturbation: float32 again with the output layer's gradients summed in another order."""
QUICK = ["--model.d-model", "64", "--model.n-layers", "1", "--model.n-heads", "2", "--model.d-ff", "128",
         "--data.seq-len", "64", "--model.max-seq-len", "64"]  # fmt: skip


def train(
    preset: str,
    dtype: str,
    seed: int,
    steps: int,
    batch: int,
    args: argparse.Namespace,
    variant: str = "scratch",
) -> dict:
    """One run from scratch; "switched": float32's run of the same seed resumed halfway in `dtype`;
    "control": from scratch with `CONTROL`."""
    switched = variant == "switched"
    run_dir = Path(args.runs) / f"{preset}-{dtype}-{seed}{f'-{variant}' * (variant != 'scratch')}"
    if switched:
        resume_halfway(Path(args.runs) / f"{preset}-float32-{seed}", run_dir, _switch_step(steps))
    data = SHARED / "tinystories"
    cmd = [sys.executable, "-m", "minigpt.cli", "train", "--preset", preset, "--data", str(data / "train.txt"),
           "--val-data", str(data / "valid.txt"), "--run-dir", str(run_dir), *["--overwrite"] * (not switched),
           "--steps", str(steps), "--max-time", "0", "--batch-size", str(batch), "--grad-accum", "1",
           "--eval-every", "0", "--ckpt-every", str(_switch_step(steps)), "--log-every", "10", "--sample-tokens", "0",
           "--model.dtype", dtype, "--seed", str(seed), *CONTROL * (variant == "control"),
           *(QUICK if args.quick else [])]  # fmt: skip
    print(f"$ python {' '.join(cmd[1:])}", flush=True)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{preset} {dtype} seed {seed} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    resolved = next(
        line for line in (out.stdout + out.stderr).splitlines() if "compute dtype" in line
    ).split()[2]
    return {
        "preset": preset,
        "dtype": dtype,
        "seed": seed,
        "variant": variant,
        "computes": resolved,
        "steps": steps,
        "batch": batch,
        "bpb": [r for r in rows if r["kind"] == "val"][-1]["bpb"],
        "curve": [(r["step"], r["loss"]) for r in train_rows],
        "tokens_per_s": train_rows[-1]["step"] * batch * _seq_len(run_dir) / train_rows[-1]["elapsed_s"],
    }


def _switch_step(steps: int) -> int:
    """Where a switched run takes over from float32's: halfway, the step every run checkpoints."""
    return steps // 2


def resume_halfway(source: Path, run_dir: Path, step: int) -> None:
    """`run_dir` as `source` was at `step`: its files, the checkpoints after `step` and the metrics after it
    left out, so that training there resumes from `step`."""
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(source, run_dir)
    for ckpt in (run_dir / "checkpoints").iterdir():
        if not ckpt.name.isdigit() or int(ckpt.name) > step:
            shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()
    if not (run_dir / "checkpoints" / str(step)).is_dir():
        raise SystemExit(f"{source} has no checkpoint at step {step} to resume from")
    metrics = run_dir / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
    metrics.write_text("".join(line + "\n" for line in kept))


def _seq_len(run_dir: Path) -> int:
    return json.loads((run_dir / "config.json").read_text())["data"]["seq_len"]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in results))
    fig, axes = plt.subplots(1, len(presets), figsize=(5.5 * len(presets), 3.8), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        runs = [r for r in results if r["preset"] == preset]
        for r in runs:
            half = _switch_step(r["steps"]) if r["variant"] == "switched" else 0
            steps, losses = zip(*[(s, loss) for s, loss in r["curve"] if s > half], strict=True)
            label = f"{r['dtype']} ({r['computes']}) seed {r['seed']}: val {r['bpb']:.4f} bits/byte"
            if half:
                label += f", from float32's step {half}"
            if r["variant"] == "control":
                label += f" ({' '.join(CONTROL)})"
            colors = {"switched": "C2", "control": "C3", "scratch": "C0" if r["dtype"] == "float32" else "C1"}
            color = colors[r["variant"]]
            style = ("-", "--", ":", "-.")[r["seed"] % 4]
            ax.plot(steps, losses, style, color=color, label=label, alpha=0.85)
        ax.set(
            title=f"{preset} preset, batch {runs[0]['batch']}",
            xlabel="step",
            ylabel="training loss (nats/token)",
        )
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _overrides(items: list[str], key: str, plan: dict[str, dict]) -> None:
    for item in items:
        name, _, value = item.partition("=")
        if name not in plan or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--{key} takes PRESET=N with N >= 1 for a preset being run, got {item!r}")
        plan[name][key] = int(value)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--presets", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    p.add_argument("--steps", nargs="*", default=[], help="PRESET=STEPS (defaults: cpu=300 tutorial=400)")
    p.add_argument(
        "--seeds", nargs="*", default=[], help="PRESET=N: seeds 0..N-1 (defaults: cpu=1 tutorial=3)"
    )
    p.add_argument("--runs", default=str(REPO / "runs" / "bench_precision"), help="where the runs go")
    p.add_argument(
        "--control", action="store_true", help=f"float32 once more per seed with {' '.join(CONTROL)}"
    )
    args = p.parse_args()
    args.plan = {name: dict(DEFAULTS[name]) for name in args.presets}
    _overrides(args.steps, "steps", args.plan)
    _overrides(args.seeds, "seeds", args.plan)
    if args.quick:
        args.plan = {"cpu": {"steps": 4, "batch": 4, "seeds": 1}}
    return args


def _row(name: str, p: dict, runs: list[dict]) -> tuple[list[str], str]:
    """One preset's table row and headline: the mean bits per byte of each dtype over the seeds."""
    runs = [r for r in runs if r["variant"] == "scratch"]
    mean = lambda d: sum(r["bpb"] for r in runs if r["dtype"] == d) / p["seeds"]
    f32, auto = mean("float32"), mean("auto")
    by_dtype = [[r for r in runs if r["dtype"] == d] for d in DTYPES]
    gaps = [a["bpb"] / f["bpb"] - 1 for f, a in zip(*by_dtype, strict=True)]
    f32_bpb = [r["bpb"] for r in runs if r["dtype"] == "float32"]
    spread = (max(f32_bpb) - min(f32_bpb)) / f32
    speed = lambda d: sum(r["tokens_per_s"] for r in runs if r["dtype"] == d) / p["seeds"]
    computes = runs[-1]["computes"]
    row = [name, p["steps"], p["batch"], p["seeds"], computes, f"{f32:.4f}", f"{auto:.4f}", f"{auto / f32 - 1:+.2%}",
           ", ".join(f"{g:+.2%}" for g in gaps), f"{spread:.2%}" if p["seeds"] > 1 else "-",
           f"{speed('float32'):,.0f}", f"{speed('auto'):,.0f}"]  # fmt: skip
    seeds = f", the mean of {p['seeds']} seeds" if p["seeds"] > 1 else ""
    line = (
        f"At equal steps the {name} preset's `--model.dtype auto` ({computes}) reaches {auto:.4f} bits per byte "
        f"against float32's {f32:.4f} ({auto / f32 - 1:+.2%}{seeds})"
    )
    return row, line


PAIRED = {
    "switched": "auto, resumed from float32's state at step {half}",
    "control": f"float32 again, {' '.join(CONTROL)}",
}


def _paired_row(name: str, variant: str, runs: list[dict]) -> tuple[list[str], str]:
    """One preset's row and headline for a variant's runs against float32's run of the same seed."""
    f32 = {r["seed"]: r["bpb"] for r in runs if r["dtype"] == "float32" and r["variant"] == "scratch"}
    paired = [r for r in runs if r["variant"] == variant]
    gaps = [r["bpb"] / f32[r["seed"]] - 1 for r in paired]
    mean_f32 = sum(f32[r["seed"]] for r in paired) / len(paired)
    mean = sum(r["bpb"] for r in paired) / len(paired)
    what = PAIRED[variant].format(half=_switch_step(paired[0]["steps"]))
    row = [name, what, paired[0]["steps"], len(paired), f"{mean_f32:.4f}", f"{mean:.4f}",
           f"{mean / mean_f32 - 1:+.2%}", ", ".join(f"{g:+.2%}" for g in gaps)]  # fmt: skip
    line = (
        f"The {name} preset, {what}, reaches {mean:.4f} bits per byte against float32's {mean_f32:.4f} "
        f"({mean / mean_f32 - 1:+.2%})"
    )
    return row, line


def main() -> None:
    args = parse_args()
    need(SHARED / "tinystories" / "train.txt", SHARED / "tinystories" / "valid.txt")
    results = [
        train(name, dtype, seed, p["steps"], p["batch"], args, variant)
        for name, p in args.plan.items()
        for seed in range(p["seeds"])
        for dtype, variant in [*((d, "scratch") for d in DTYPES), ("auto", "switched")]
        + [("float32", "control")] * args.control
    ]
    made = [_row(n, p, [r for r in results if r["preset"] == n]) for n, p in args.plan.items()]
    rows, lines = [row for row, _ in made], [line for _, line in made]
    variants = ["switched", *["control"] * args.control]
    pairs = [_paired_row(n, v, [r for r in results if r["preset"] == n]) for n in args.plan for v in variants]
    columns = ["preset", "steps", "batch", "seeds", "auto computes", "float32 val bits/byte",
               "auto val bits/byte", "auto - float32", "each seed's", "float32's spread over seeds",
               "float32 tokens/s", "auto tokens/s"]  # fmt: skip
    note = "Target: within 0.5%. Bits per byte are means over the seeds; the spread is (max - min) / mean."
    out = [table(columns, rows, "Validation bits per byte at equal steps", note)]
    columns = ["preset", "against float32's run", "steps", "seeds", "float32 val bits/byte", "its val bits/byte",
               "it - float32", "each seed's"]  # fmt: skip
    note = ("Each run is paired with float32's run of its seed. Resumed: the dtype's own effect (target: within "
            "0.5%). The control: how far a last-bit difference moves a run from scratch.")  # fmt: skip
    out.append(table(columns, [row for row, _ in pairs], "Against float32's run of the same seed", note))
    lines += [line for _, line in pairs]
    print_tables(out)
    figure = Path(args.out) / "bench_precision.png"
    plot(results, figure)
    write_result(args, "bench_precision", "Mixed precision against float32 at equal steps", out,
                 headlines=lines, data={"runs": results, "figure_png": str(figure.resolve())},
                 code=code_version())  # fmt: skip


if __name__ == "__main__":
    main()
