"""Validation bits per byte of the cpu preset after the same training budget with each optimizer.

    python benchmarks/compare_optimizers.py --data ../shared/data/tinystories/train.txt \
        --val-data ../shared/data/tinystories/valid.txt --steps 300

The budget is a number of steps (the same tokens for every optimizer), so results do not depend on what else
the machine is doing; wall time per run is printed too. Learning rates are each optimizer's usual scale:
Lion ~5x below AdamW, Muon's 0.02 for hidden matrices (its AdamW part for embeddings runs at 0.1x).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

from minigpt.config import PRESETS, TrainConfig
from minigpt.optimizer import AdamW, CosineDecaySchedule, Lion, Muon, WSDSchedule
from minigpt.training.train import train

GPT2_BLOCK = {
    "norm": "layernorm",
    "position": "learned",
    "activation": "gelu",
    "qk_norm": False,
    "bias": True,
}


def variants(steps: int, block: str) -> dict[str, TrainConfig]:
    base = PRESETS["cpu"]
    if (
        block == "gpt2"
    ):  # the cpu preset's shape with GPT-2's block (LayerNorm, learned positions, GELU, biases)
        base = dataclasses.replace(base, model=dataclasses.replace(base.model, **GPT2_BLOCK))
    warmup = max(1, steps // 20)

    def cosine(peak: float) -> CosineDecaySchedule:
        return CosineDecaySchedule(warmup_steps=warmup, peak_lr=peak, decay_steps=steps, decay_lr=peak / 10)

    return {
        "AdamW + cosine": dataclasses.replace(base, optimizer=AdamW(weight_decay=0.1), schedule=cosine(2e-3)),
        "AdamW + WSD": dataclasses.replace(
            base,
            optimizer=AdamW(weight_decay=0.1),
            schedule=WSDSchedule(warmup_steps=warmup, peak_lr=2e-3, total_steps=steps, decay_fraction=0.3),
        ),
        "Lion + cosine": dataclasses.replace(base, optimizer=Lion(weight_decay=0.5), schedule=cosine(4e-4)),
        "Muon + cosine": dataclasses.replace(
            base, optimizer=Muon(adam_lr_ratio=0.1, weight_decay=0.01), schedule=cosine(0.02)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--val-data", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", nargs="*", help="run only these variants (by name)")
    parser.add_argument(
        "--block", choices=["preset", "gpt2"], default="preset", help="the cpu preset's block or GPT-2's"
    )
    args = parser.parse_args()
    rows = []
    for name, cfg in variants(args.steps, args.block).items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = dataclasses.replace(
                cfg,
                run_dir=run_dir,
                data=dataclasses.replace(cfg.data, paths=tuple(args.data), val_paths=tuple(args.val_data)),
                steps=args.steps,
                max_time=0.0,  # a fixed number of steps: the preset's time budget would cut slow variants short
                eval_every=args.steps,
                ckpt_every=args.steps,
                log_every=max(1, args.steps // 10),
            )
            t0 = time.time()
            result = train(cfg)
            rows.append((name, result["bpb"], result["loss"], time.time() - t0))
    print(
        f"\n{args.steps} steps x {PRESETS['cpu'].batch_size} x {PRESETS['cpu'].data.seq_len} tokens, cpu preset"
    )
    print("| optimizer + schedule | val bits/byte | val loss | wall time |")
    print("|---|---:|---:|---:|")
    for name, bpb, loss, seconds in rows:
        print(f"| {name} | {bpb:.4f} | {loss:.4f} | {seconds:.0f} s |")


if __name__ == "__main__":
    main()
