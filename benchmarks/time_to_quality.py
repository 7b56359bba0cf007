"""Time to quality: the `tutorial` preset (the seed's recipe) against the `cpu` preset, same wall-clock budget.

    python benchmarks/time_to_quality.py --data ../shared/data/tinystories/train.txt \
        --val-data ../shared/data/tinystories/valid.txt --minutes 10

Both train in this one process, one after the other, for at most the same training time (evaluation and
saving are not counted; the cpu preset's schedule is sized to end near 10 minutes on a 2-core machine), evaluating on the whole validation split as they go. It prints the time each took to reach
the tutorial preset's final validation bits per byte, their ratio, a sample story from each, and writes
`time_to_quality.png` (bits per byte against training time) and `time_to_quality.json` to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from minigpt.config import PRESETS, TrainConfig
from minigpt.metrics import read_metrics
from minigpt.train import train


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


def run(name: str, cfg: TrainConfig, args: argparse.Namespace, eval_every: int) -> dict:
    run_dir = Path(args.out) / name
    cfg = dataclasses.replace(
        cfg,
        run_dir=str(run_dir),
        overwrite=True,
        data=dataclasses.replace(cfg.data, paths=tuple(args.data), val_paths=tuple(args.val_data)),
        max_time=args.minutes * 60,  # the preset's own step count, or the budget, whichever ends first
        eval_every=eval_every,
        ckpt_every=1_000_000,
        log_every=max(1, eval_every // 4),
    )
    t0 = time.time()
    result = train(cfg)
    records = read_metrics(run_dir)
    curve = [(r["elapsed_s"], r["bpb"]) for r in records if r["kind"] == "val"]
    train_logs = [r for r in records if r["kind"] == "train"]
    samples = (run_dir / "samples.txt").read_text().split("--- step ")[-1]
    return {
        "curve": curve,
        "final_bpb": result["bpb"],
        "steps": result["step"],
        "tokens_per_s": train_logs[-1]["tokens_per_s"] if train_logs else None,
        "wall_s": time.time() - t0,
        "sample": samples.split("\n", 1)[1].strip(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--val-data", nargs="*", default=[])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--out", default="runs/time_to_quality")
    parser.add_argument(
        "--tutorial-batch",
        type=int,
        default=48,
        help="the tutorial's 144 x 256 batch materialises 144 x 256 x 50304 float32 logits and their gradients "
        "(~36 GB): on a 24 GB machine use 48",
    )
    parser.add_argument("--tutorial-eval-every", type=int, default=10)
    parser.add_argument("--cpu-eval-every", type=int, default=50)
    args = parser.parse_args()

    results = {
        "tutorial": run(
            "tutorial",
            dataclasses.replace(PRESETS["tutorial"], batch_size=args.tutorial_batch),
            args,
            args.tutorial_eval_every,
        ),
        "cpu": run("cpu", PRESETS["cpu"], args, args.cpu_eval_every),
    }
    target = results["tutorial"]["final_bpb"]
    t_tut = time_to_reach(results["tutorial"]["curve"], target)
    t_cpu = time_to_reach(results["cpu"]["curve"], target)
    print(
        f"\ntarget: the tutorial preset's validation bits per byte after {args.minutes:g} min = {target:.4f}"
    )
    print("| preset | steps | tokens/s | final val bits/byte | time to reach the target |")
    print("|---|---:|---:|---:|---:|")
    for name, t in (("tutorial", t_tut), ("cpu", t_cpu)):
        r = results[name]
        print(
            f"| {name} | {r['steps']} | {r['tokens_per_s']:,.0f} | {r['final_bpb']:.4f} | "
            f"{'not reached' if t is None else f'{t:.0f} s'} |"
        )
    ratio = t_tut / t_cpu if t_tut and t_cpu else None
    print(f"speed-up to the tutorial's quality: {'n/a' if ratio is None else f'{ratio:.1f}x'}")
    for name in results:
        print(f"\nsample ({name}): {results[name]['sample']}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot([t / 60 for t, _ in r["curve"]], [b for _, b in r["curve"]], "o-", label=f"{name} preset")
    ax.axhline(target, color="gray", ls="--", lw=1, label="tutorial's final")
    ax.set_xlabel("training time (minutes)")
    ax.set_ylabel("validation bits per byte")
    ax.set_title(f"time to quality on TinyStories ({'n/a' if ratio is None else f'{ratio:.1f}x'} faster)")
    ax.legend()
    fig.tight_layout()
    out = Path(args.out)
    fig.savefig(out / "time_to_quality.png", dpi=110)
    (out / "time_to_quality.json").write_text(
        json.dumps({**results, "target": target, "ratio": ratio}, indent=2)
    )
    print(f"\nwrote {out / 'time_to_quality.png'} and {out / 'time_to_quality.json'}")


if __name__ == "__main__":
    main()
