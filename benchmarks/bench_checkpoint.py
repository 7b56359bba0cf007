"""Time per checkpoint save and restore, and what verifying checkpoints by content adds to each.

A save's blocking part is what the training loop waits for; the full save includes Orbax's asynchronous write;
the manifest (a sha256 of every file of the step) is hashed after that, in a background thread, so the loop
sees it only if the next save comes before it ends. A restore verifies the manifest first: its cost is shown
beside the restore itself.

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
from minigpt.nn.model import count_params
from minigpt.training.checkpoint import Checkpointer, verify, write_manifest
from minigpt.training.trainer import build, init_state

VOCAB = {"cpu": 4096, "tutorial": 50257, "gpt2-124m": 50257}


def bench(preset: str, repeats: int) -> dict[str, float]:
    cfg = PRESETS[preset]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB[preset]))
    setup = build(cfg)
    state = init_state(setup)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    times: dict[str, list[float]] = {
        k: [] for k in ("blocking_s", "total_s", "hash_s", "restore_s", "verify_s")
    }
    with tempfile.TemporaryDirectory() as run_dir:
        ckpt = Checkpointer(run_dir, keep=2)
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            ckpt.save(step, state.saved(), {"next_index": step}, {"step": step})
            t1 = time.perf_counter()
            ckpt.manager.wait_until_finished()
            t2 = time.perf_counter()
            ckpt.close()  # waits for the background manifest: timed again below, alone
            write_manifest(ckpt.directory / str(step))
            t3 = time.perf_counter()
            verify(ckpt.directory / str(step))
            t4 = time.perf_counter()
            ckpt.restore(setup.abstract_state.saved())  # verifies, then restores
            t5 = time.perf_counter()
            ckpt = Checkpointer(run_dir, keep=2)
            if step:  # the first save also creates folders and warms caches
                for k, v in zip(
                    times, (t1 - t0, t2 - t0, t3 - t2, t5 - t4 - (t4 - t3), t4 - t3), strict=True
                ):
                    times[k].append(v)
        ckpt.close()
    return {
        "params_M": count_params(state.params) / 1e6,
        "state_MiB": nbytes / 2**20,
        **{k: statistics.median(v) for k, v in times.items()},
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
         f"{r['total_s'] * 1e3:.0f} ms", f"{r['hash_s'] * 1e3:.0f} ms ({r['hash_s'] / r['total_s']:.0%})",
         f"{r['restore_s'] * 1e3:.0f} ms", f"{r['verify_s'] * 1e3:.0f} ms ({r['verify_s'] / r['restore_s']:.0%})"]
        for preset, r in results.items()
    ]  # fmt: skip
    columns = ["preset", "params", "state (params + AdamW)", "blocking part of save", "full async save",
               "manifest, in the background (/ full save)", "restore", "verify before restore (/ restore)"]  # fmt: skip
    note = f"Median of {args.repeats} saves and restores after a first, untimed one."
    tables = [table(columns, rows, note=note)]
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
