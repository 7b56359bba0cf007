"""Mixed precision against float32 at equal steps: the same run, step for step, with `--model.dtype auto`
(bfloat16 products with float32 accumulation where this machine has the matrix units for it) and with
`--model.dtype float32`, on real text, compared by validation bits per byte and by their loss curves.

    python benchmarks/bench_precision.py                   # cpu preset 300 steps, tutorial (batch 16) 150
    python benchmarks/bench_precision.py --presets cpu --steps cpu=150
    python benchmarks/bench_precision.py --quick            # a few steps of a small model

Each run is `minigpt train --preset P --steps N --max-time 0` in its own process, one after the other, on the
shared data folder's TinyStories (train and validation slices), with the same seed, data order and schedule;
the whole validation split is evaluated at the end. The tutorial preset trains at batch 16 (its own is 144,
hours on a CPU); its dropout draws the same masks in both runs. Target: the two runs' bits per byte within
0.5% of each other. The plot puts both runs' training losses on one figure per preset.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import REPO, SHARED, code_version, need, parser, print_tables, table, write_result

DEFAULTS = {"cpu": {"steps": 300, "batch": 48}, "tutorial": {"steps": 150, "batch": 16}}
DTYPES = ("float32", "auto")
QUICK = ["--model.d-model", "64", "--model.n-layers", "1", "--model.n-heads", "2", "--model.d-ff", "128",
         "--data.seq-len", "64", "--model.max-seq-len", "64"]  # fmt: skip


def train(preset: str, dtype: str, steps: int, batch: int, args: argparse.Namespace) -> dict:
    run_dir = Path(args.runs) / f"{preset}-{dtype}"
    data = SHARED / "tinystories"
    cmd = [sys.executable, "-m", "minigpt.cli", "train", "--preset", preset, "--data", str(data / "train.txt"),
           "--val-data", str(data / "valid.txt"), "--run-dir", str(run_dir), "--overwrite", "--steps", str(steps),
           "--max-time", "0", "--batch-size", str(batch), "--grad-accum", "1", "--eval-every", "0",
           "--ckpt-every", "0", "--log-every", "10", "--sample-tokens", "0", "--model.dtype", dtype,
           *(QUICK if args.quick else [])]  # fmt: skip
    print(f"$ python {' '.join(cmd[1:])}", flush=True)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{preset} {dtype} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    resolved = next(
        line for line in (out.stdout + out.stderr).splitlines() if "compute dtype" in line
    ).split()[2]
    return {
        "preset": preset,
        "dtype": dtype,
        "computes": resolved,
        "steps": steps,
        "batch": batch,
        "bpb": [r for r in rows if r["kind"] == "val"][-1]["bpb"],
        "curve": [(r["step"], r["loss"]) for r in train_rows],
        "tokens_per_s": train_rows[-1]["step"] * batch * _seq_len(run_dir) / train_rows[-1]["elapsed_s"],
    }


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
            steps, losses = zip(*r["curve"], strict=True)
            label = f"{r['dtype']} ({r['computes']}): val {r['bpb']:.4f} bits/byte"
            ax.plot(steps, losses, label=label, alpha=0.85)
        ax.set(
            title=f"{preset} preset, batch {runs[0]['batch']}",
            xlabel="step",
            ylabel="training loss (nats/token)",
        )
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--presets", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    p.add_argument("--steps", nargs="*", default=[], help="PRESET=STEPS (defaults: cpu=600 tutorial=150)")
    p.add_argument("--runs", default=str(REPO / "runs" / "bench_precision"), help="where the runs go")
    args = p.parse_args()
    args.plan = {name: dict(DEFAULTS[name]) for name in args.presets}
    for item in args.steps:
        name, _, steps = item.partition("=")
        args.plan[name]["steps"] = int(steps)
    if args.quick:
        args.plan = {"cpu": {"steps": 4, "batch": 4}}
    return args


def main() -> None:
    args = parse_args()
    need(SHARED / "tinystories" / "train.txt", SHARED / "tinystories" / "valid.txt")
    results = [
        train(name, dtype, p["steps"], p["batch"], args) for name, p in args.plan.items() for dtype in DTYPES
    ]
    rows, lines = [], []
    for name, p in args.plan.items():
        f32, auto = (next(r for r in results if r["preset"] == name and r["dtype"] == d) for d in DTYPES)
        gap = auto["bpb"] / f32["bpb"] - 1
        rows.append([name, p["steps"], p["batch"], auto["computes"], f"{f32['bpb']:.4f}", f"{auto['bpb']:.4f}",
                     f"{gap:+.2%}", f"{f32['tokens_per_s']:,.0f}", f"{auto['tokens_per_s']:,.0f}"])  # fmt: skip
        lines.append(
            f"At equal steps the {name} preset's `--model.dtype auto` ({auto['computes']}) reaches "
            f"{auto['bpb']:.4f} bits per byte against float32's {f32['bpb']:.4f} ({gap:+.2%})"
        )
    columns = ["preset", "steps", "batch", "auto computes", "float32 val bits/byte", "auto val bits/byte",
               "auto - float32", "float32 tokens/s", "auto tokens/s"]  # fmt: skip
    out = [table(columns, rows, "Validation bits per byte at equal steps", "Target: within 0.5%.")]
    print_tables(out)
    figure = Path(args.out) / "bench_precision.png"
    plot(results, figure)
    write_result(args, "bench_precision", "Mixed precision against float32 at equal steps", out,
                 headlines=lines, data={"runs": results, "figure_png": str(figure.resolve())},
                 code=code_version())  # fmt: skip


if __name__ == "__main__":
    main()
