"""The training step on an accelerator: tokens/s, MFU, compile time, memory and where the device time goes.

    python benchmarks/bench_accelerator.py                 # on a TPU or GPU: tutorial, accelerator, gpt2-124m
    python benchmarks/bench_accelerator.py --points gpt2-124m:16 gpt2-124m:32
    python benchmarks/bench_accelerator.py --quick         # anywhere: the cpu preset at batch 4

Each point builds the preset at that batch (no gradient accumulation), compiles its train step cold (no
persistent cache: the time a new user's first run spends), runs --steps steps back to back (as the training
loop dispatches them) and reports tokens/s, MFU against the device's vendor peak, XLA's memory for the step
beside `minigpt plan`'s, and a profile's split of the device time into attention, the output layer's loss,
the optimizer, the other matrix products, the rest, and idle (`minigpt.tools.breakdown`). Without an
accelerator (and without --quick) it is skipped: on a CPU, bench_speed is the step benchmark.
"""

from __future__ import annotations

import dataclasses
import time

import jax
from common import parser, print_tables, skip, table, write_result

from minigpt.config import get_preset
from minigpt.tools.bench import bench_config, compile_step
from minigpt.tools.breakdown import breakdown
from minigpt.training import hardware
from minigpt.training.devices import local_kind
from minigpt.training.memory import make_plan
from minigpt.training.metrics import flops_per_step

POINTS = ("tutorial:144", "tutorial:256", "accelerator:128", "gpt2-124m:16", "gpt2-124m:32")
SHARES = ("attention", "loss", "optimizer", "matmul", "other", "idle")


def measure(name: str, batch: int, steps: int) -> dict:
    """One point: compile, time `steps` pipelined steps, profile a few more."""
    cfg = bench_config(dataclasses.replace(get_preset(name), batch_size=batch, grad_accum=1))
    row: dict = {"preset": name, "batch": batch, "tokens_per_step": batch * cfg.data.seq_len}
    try:
        step = compile_step(cfg)
        row["compile_s"], row["xla_gib"] = step.compile_s, (step.memory_bytes or 0) / 2**30
        row["plan_gib"] = make_plan(step.setup.cfg, local_kind(), 1).total / 2**30
        jax.block_until_ready(step())
        t = time.perf_counter()
        for _ in range(steps):
            metrics = step()
        jax.block_until_ready(metrics)
        seconds = (time.perf_counter() - t) / steps
        peak = hardware.peak(jax.devices()[0])
        row["tokens_per_s"] = row["tokens_per_step"] / seconds
        row["mfu"] = flops_per_step(step.setup.cfg) / seconds / peak.flops if peak else None
        row["shares"] = breakdown(step.xla, step, steps=3).shares()
    except Exception as e:  # a row with the reason (out of memory, ...), never a crash
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def rows(results: list[dict]) -> list[list[str]]:
    out = []
    for r in results:
        if "error" in r:
            out.append([r["preset"], r["batch"], r["error"], *[""] * (5 + len(SHARES))])
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        shares = [f"{r['shares'].get(k, 0):.0%}" if k in r["shares"] else "n/a" for k in SHARES]
        out.append([r["preset"], r["batch"], f"{r['tokens_per_s']:,.0f}", mfu, f"{r['compile_s']:.1f}",
                    f"{r['xla_gib']:.2f}", f"{r['plan_gib']:.2f}", *shares])  # fmt: skip
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--points", nargs="+", default=list(POINTS), help="PRESET:BATCH to measure")
    p.add_argument("--steps", type=int, default=10, help="steps timed back to back per point")
    args = p.parse_args()
    if args.quick:
        args.points, args.steps = ["cpu:4"], 2
    elif jax.default_backend() == "cpu":
        skip("needs a TPU or GPU (this machine has a CPU only; bench_speed measures its step)")
    results = [measure(point.split(":")[0], int(point.split(":")[1]), args.steps) for point in args.points]
    device = jax.devices()[0].device_kind
    columns = ["preset", "batch", "tokens/s", "MFU", "compile s", "XLA GiB", "plan GiB", *SHARES]
    note = (f"One {device}; no gradient accumulation; compile cold; MFU against the vendor's peak; the shares are "
            "of the device time of profiled steps (idle: the device waiting between ops).")  # fmt: skip
    tables = [table(columns, rows(results), note=note)]
    best = max((r for r in results if r.get("mfu") is not None), key=lambda r: r["mfu"], default=None)
    headlines = [] if args.quick or best is None else [
        f"On one {device}, the {best['preset']} preset at batch {best['batch']} trains "
        f"{best['tokens_per_s']:,.0f} tokens/s at MFU {best['mfu']:.0%}, compiled in {best['compile_s']:.0f} s"
    ]  # fmt: skip
    print_tables(tables)
    write_result(args, "bench_accelerator", "The training step on an accelerator", tables,
                 headlines=headlines, data=results)  # fmt: skip


if __name__ == "__main__":
    main()
