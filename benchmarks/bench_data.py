"""Data pipeline throughput: how fast text becomes tokens, and whether the loader keeps up with training.

    python benchmarks/bench_data.py [--text PATH] [--gpt2-dir DIR] [--workers 0 1 2]

Prints, for a fresh token cache each time, prepare throughput (MB of source text per second, including
BPE training for `bpe`) for the GPT-2 and the trained-BPE tokenizers; then the loader's throughput
(tokens/s through `train_iterator` at the cpu preset's 32 x 128 batches) next to the cpu preset's training
consumption (tokens/s of train steps, vocabulary 4096) and their ratio, which should be >= 20.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from minigpt.config import DataConfig, get_preset
from minigpt.loader import train_iterator
from minigpt.store import TokenStore, prepare

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def bench_prepare(
    text: Path, val: Path | None, tokenizer: str, gpt2_dir: str, workers: int, cache: Path
) -> TokenStore:
    cfg = DataConfig(
        paths=(str(text),),
        val_paths=(str(val),) if val else (),
        tokenizer=tokenizer,  # type: ignore[arg-type]
        bpe_vocab_size=4096,
        gpt2_dir=gpt2_dir,
        cache_dir=str(cache),  # fresh: nothing cached
        tokenize_workers=workers,
    )
    t0 = time.perf_counter()
    store = prepare(cfg)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    prepare(cfg)
    cached = time.perf_counter() - t1
    mb = sum(f["size"] for s in store.meta["sources"].values() for f in s) / 1e6
    tokens = sum(s["tokens"] for s in store.meta["splits"].values())
    print(
        f"prepare {tokenizer:4s} workers={store.meta['build']['workers']}: {mb:.1f} MB in {seconds:.1f} s "
        f"= {mb / seconds:.1f} MB/s ({tokens / seconds / 1e6:.2f} M tokens/s); "
        f"cached re-run {cached * 1e3:.0f} ms",
        flush=True,
    )
    return store


def bench_loader(store: TokenStore, seq_len: int, batch: int, n_batches: int) -> float:
    it = train_iterator(store, seq_len, batch, seed=0)
    for _ in range(20):
        next(it)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        x = next(it)
    seconds = time.perf_counter() - t0
    assert x.shape == (batch, seq_len + 1)
    return n_batches * batch * seq_len / seconds


def bench_training(steps: int) -> tuple[float, int, int]:
    import jax

    from minigpt import sharding
    from minigpt.trainer import build, init_state, make_train_step, resolve_model

    cfg = get_preset("cpu")
    cfg = resolve_model(cfg, 4096)
    cfg = dataclasses.replace(cfg, run_dir=tempfile.mkdtemp(prefix="bench_data_run_"))
    setup = build(cfg)
    state = init_state(setup)
    step_fn = make_train_step(setup)
    seq_len, batch = cfg.data.seq_len, cfg.batch_size
    rng = np.random.default_rng(0)

    def make_batch():
        local = rng.integers(0, 4096, (cfg.grad_accum, batch, seq_len + 1), dtype=np.int32)
        return sharding.global_batch(setup.mesh, local, micro_batches=True)

    with sharding.set_mesh(setup.mesh):
        for _ in range(3):  # compile and warm up
            state, metrics = step_fn(state, make_batch())
        jax.block_until_ready(metrics)
        batches = [make_batch() for _ in range(steps)]
        t0 = time.perf_counter()
        for b in batches:
            state, metrics = step_fn(state, b)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
    return steps * batch * cfg.grad_accum * seq_len / seconds, batch, seq_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", type=Path, default=SHARED / "tinystories" / "train.txt")
    p.add_argument("--val", type=Path, default=SHARED / "tinystories" / "valid.txt")
    p.add_argument("--gpt2-dir", default=str(SHARED / "gpt2"))
    p.add_argument("--workers", type=int, nargs="+", default=[0], help="tokenize_workers values to try")
    p.add_argument("--tokenizers", nargs="+", default=["gpt2", "bpe"])
    p.add_argument("--loader-batches", type=int, default=2000)
    p.add_argument("--train-steps", type=int, default=10)
    a = p.parse_args()
    if not a.text.is_file():
        sys.exit(f"no text at {a.text}; pass --text PATH")
    val = a.val if a.val and a.val.is_file() else None

    with tempfile.TemporaryDirectory(prefix="bench_data_") as root:
        stores = {}
        for tokenizer in a.tokenizers:
            for workers in a.workers:
                cache = Path(root) / f"{tokenizer}-{workers}"
                stores[tokenizer] = bench_prepare(a.text, val, tokenizer, a.gpt2_dir, workers, cache)
        store = stores.get("bpe") or next(iter(stores.values()))
        train_tps, batch, seq_len = bench_training(a.train_steps)
        loader_tps = bench_loader(store, seq_len, batch, a.loader_batches)
    ratio = loader_tps / train_tps
    print(
        f"loader  ({store.meta['tokenizer_identity']}, {batch} x {seq_len}): {loader_tps / 1e6:.2f} M tokens/s"
    )
    print(f"training (cpu preset, vocab 4096, {batch} x {seq_len}): {train_tps / 1e3:.1f} k tokens/s")
    print(f"loader / training = {ratio:.0f}x ({'ok' if ratio >= 20 else 'TOO SLOW'}: needs >= 20x)")


if __name__ == "__main__":
    main()
