"""Time per checkpoint save: the blocking part (what the training loop waits for) and the full asynchronous write.

    python benchmarks/bench_checkpoint.py                 # cpu preset and a GPT-2 124M model
    python benchmarks/bench_checkpoint.py --presets cpu   # just one
    python benchmarks/bench_checkpoint.py --quick         # the cpu preset, one timed save

Parameters and AdamW state are random-initialised at each preset's shape (vocabulary 4096 for the cpu
preset's trained BPE, 50257 for GPT-2); nothing is trained. Each figure is the median of --repeats saves.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time

import jax
from common import parser, print_tables, table, write_result

from minigpt.config import PRESETS
from minigpt.model import count_params
from minigpt.training.checkpoint import Checkpointer
from minigpt.training.trainer import build, init_state

VOCAB = {"cpu": 4096, "tutorial": 50257, "gpt2-124m": 50257}


def bench(preset: str, repeats: int) -> dict[str, float]:
    cfg = PRESETS[preset]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB[preset]))
    setup = build(cfg)
    state = init_state(setup)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    blocking, total = [], []
    with tempfile.TemporaryDirectory() as run_dir:
        ckpt = Checkpointer(run_dir, keep=2)
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            ckpt.save(step, state, {"next_index": step}, {"step": step})
            t1 = time.perf_counter()
            ckpt.manager.wait_until_finished()
            t2 = time.perf_counter()
            if step:  # the first save also creates folders and warms caches
                blocking.append(t1 - t0)
                total.append(t2 - t0)
        ckpt.close()
    return {
        "params_M": count_params(state.params) / 1e6,
        "state_MiB": nbytes / 2**20,
        "blocking_s": statistics.median(blocking),
        "total_s": statistics.median(total),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--presets", nargs="+", default=["cpu", "gpt2-124m"], choices=list(VOCAB))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.presets, args.repeats = ["cpu"], 1
    results = {preset: bench(preset, args.repeats) for preset in args.presets}
    rows = [
        [preset, f"{r['params_M']:.1f}M", f"{r['state_MiB']:.0f} MiB", f"{r['blocking_s'] * 1e3:.0f} ms",
         f"{r['total_s'] * 1e3:.0f} ms"]
        for preset, r in results.items()
    ]  # fmt: skip
    columns = ["preset", "params", "state (params + AdamW)", "blocking part of save", "full async save"]
    tables = [table(columns, rows, note=f"Median of {args.repeats} saves after a first, untimed one.")]
    print_tables(tables)
    headlines = [
        f"Saving the {p} preset's {r['state_MiB']:.0f} MiB of state holds training up for "
        f"{r['blocking_s'] * 1e3:.0f} ms (the rest of the {r['total_s'] * 1e3:.0f} ms save runs in the background)"
        for p, r in results.items()
        if p == "gpt2-124m"
    ]
    write_result(args, "bench_checkpoint", "Checkpoint saves", tables, headlines=headlines, data=results)


if __name__ == "__main__":
    main()
