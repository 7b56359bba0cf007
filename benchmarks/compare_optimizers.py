"""Validation bits per byte of the cpu preset after the same training budget with each optimizer.

    python benchmarks/compare_optimizers.py                 # TinyStories, 100 steps each
    python benchmarks/compare_optimizers.py --data ../shared/data/gutenberg --steps 300
    python benchmarks/compare_optimizers.py --quick         # Muon, 2 steps on TinyStories' validation text

The budget is a number of steps (the same tokens for every optimizer), so results do not depend on what else
the machine is doing; wall time per run is printed too. Learning rates are each optimizer's usual scale:
Lion ~5x below AdamW, Muon's 0.02 for hidden matrices (its AdamW part for embeddings runs at 0.1x).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from common import SHARED, need, parser, print_tables, table, write_result

from minigpt.app.train import train
from minigpt.config import PRESETS, TrainConfig
from minigpt.optim.optimizer import AdamW, CosineDecaySchedule, Lion, Muon, WSDSchedule

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
    p = parser(__doc__)
    p.add_argument("--data", nargs="+", default=[str(SHARED / "tinystories" / "train.txt")])
    p.add_argument("--val-data", nargs="*", default=[str(SHARED / "tinystories" / "valid.txt")])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--only", nargs="*", help="run only these variants (by name)")
    p.add_argument(
        "--block", choices=["preset", "gpt2"], default="preset", help="the cpu preset's block or GPT-2's"
    )
    args = p.parse_args()
    if args.quick:  # the preset's own optimizer, on a corpus whose tokenizer trains in a second
        args.data, args.val_data, args.steps = [str(SHARED / "tinystories" / "valid.txt")], [], 2
        args.only = ["Muon + cosine"]
    need(*map(Path, args.data + args.val_data))
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
            rows.append([name, f"{result['bpb']:.4f}", f"{result['loss']:.4f}", f"{time.time() - t0:.0f} s"])
    cpu = PRESETS["cpu"]
    title = (
        f"{args.steps} steps x {cpu.batch_size} x {cpu.data.seq_len} tokens, cpu preset ({args.block} block)"
    )
    tables = [table(["optimizer + schedule", "val bits/byte", "val loss", "wall time"], rows, title)]
    print_tables(tables)
    write_result(args, "compare_optimizers", "Optimizers at the same number of steps", tables, data=rows)


if __name__ == "__main__":
    main()
