"""Data pipeline throughput: how fast text becomes tokens, and whether the loader keeps up with training.

    python benchmarks/bench_data.py [--text PATH] [--gpt2-dir DIR] [--workers 0 1 2]
    python benchmarks/bench_data.py --gb 2                  # a 2 GB corpus, 1 worker and one per core

Prints, for a fresh token cache each time, prepare throughput (MB of source text per second, including
BPE training for `bpe`) for the GPT-2 and the trained-BPE tokenizers; then the loader's throughput
(tokens/s through `train_iterator` at the cpu preset's 32 x 128 batches) next to the cpu preset's training
consumption (tokens/s of train steps, vocabulary 4096) and their ratio, which should be >= 20; the loader
again with a mixture of two sources and with windows that start at documents, and training with
--model.document-attention against without (best of two each, taking turns).

Each prepare runs in a fresh process, so its peak resident memory (and its workers' largest) is its own; its
rate is given per second of wall time and per CPU-second (all its processes), which other processes on a
shared machine disturb less. With `--gb N`, the text is an N GB corpus built in a temporary folder from the
shared TinyStories and Gutenberg texts (repeated; deleted afterwards), prepared with GPT-2's tokenizer by 1
worker and by one per core, and compared with tiktoken's own `encode_ordinary_batch` on the same documents
(the same 1 MiB chunks prepare tokenizes; only the encoding is timed), single-threaded and on every core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from child_process import read_result, report

from minigpt.config import DataConfig, get_preset
from minigpt.data.corpus import FileStats, read_records
from minigpt.data.loader import train_iterator
from minigpt.data.store import CHUNK_CHARS, TokenStore, prepare
from minigpt.data.tokenizer import EOT, GPT2Tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def data_config(
    text: Path, val: Path | None, tokenizer: str, gpt2_dir: str, workers: int, cache: Path
) -> DataConfig:
    return DataConfig(
        paths=(str(text),),
        val_paths=(str(val),) if val else (),
        tokenizer=tokenizer,  # type: ignore[arg-type]
        bpe_vocab_size=4096,
        gpt2_dir=gpt2_dir,
        cache_dir=str(cache),  # fresh: nothing cached
        tokenize_workers=workers,
    )


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that ended (a prepare's workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child(spec: str) -> None:
    """Prepare the store `spec` describes in this fresh process; report time, CPU time and peak memory."""
    cfg = DataConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(spec).items()})
    cpu, t0 = _cpu_seconds(), time.perf_counter()
    store = prepare(cfg)
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu
    workers_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    report(
        {"seconds": seconds, "cpu_seconds": cpu, "workers_peak_rss_bytes": workers_rss, "meta": store.meta}
    )


def bench_prepare(cfg: DataConfig) -> tuple[TokenStore, dict]:
    """Prepare `cfg` in a fresh process; the store (opened here: a cached re-run, timed) and its figures."""
    spec = json.dumps(dataclasses.asdict(cfg))
    proc = subprocess.run([sys.executable, __file__, "--child", spec], stdout=subprocess.PIPE, text=True)
    result = read_result(proc.stdout)
    if proc.returncode or result is None:
        sys.exit(f"prepare failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}")
    t0 = time.perf_counter()
    store = prepare(cfg)
    cached = time.perf_counter() - t0
    meta, seconds = result["meta"], result["seconds"]
    mb = sum(f["size"] for s in meta["sources"].values() for f in s) / 1e6
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    result |= {"mb": mb, "mb_per_s": mb / seconds, "mb_per_cpu_s": mb / result["cpu_seconds"]}
    print(
        f"prepare {cfg.tokenizer:4s} workers={meta['build']['workers']}: {mb:,.1f} MB in {seconds:.1f} s "
        f"= {mb / seconds:.2f} MB/s, {result['mb_per_cpu_s']:.2f} MB per CPU-second "
        f"({tokens / seconds / 1e6:.2f} M tokens/s); peak RSS {result['peak_rss_bytes'] / 2**20:,.0f} MiB "
        f"(largest worker {result['workers_peak_rss_bytes'] / 2**20:,.0f} MiB); cached re-run {cached * 1e3:.0f} ms",
        flush=True,
    )
    return store, result


def build_corpus(path: Path, gb: float) -> Path:
    """A corpus of at least `gb` GB at `path`: TinyStories' training text and the Gutenberg books (each book
    one document, so some documents are megabytes long), repeated; written block by block."""
    texts = [SHARED / "tinystories" / "train.txt", *sorted((SHARED / "gutenberg").glob("[0-9]*.txt"))]
    if not all(t.is_file() for t in texts):
        sys.exit(f"the shared texts are not at {SHARED}; pass --text PATH instead of --gb")
    unit = b"".join(t.read_bytes().strip() + f"\n{EOT}\n".encode() for t in texts)  # about 16 MB
    with open(path, "wb") as f:
        for _ in range(-int(-gb * 1e9 // len(unit))):
            f.write(unit)
    return path


def chunks(text: Path, max_bytes: float) -> Iterator[tuple[list[str], int]]:
    """The documents prepare reads from `text`, in chunks of CHUNK_CHARS as prepare tokenizes them, with the
    source bytes read for each; up to `max_bytes` of the file."""
    chunk, chars, read, reported = [], 0, [], 0
    for piece, _, _ in read_records(text, DataConfig(), FileStats(), advance=read.append):
        chunk.append(piece)
        chars += len(piece)
        if chars >= CHUNK_CHARS:
            total = sum(read)
            yield chunk, total - reported
            chunk, chars, reported = [], 0, total
            if total >= max_bytes:
                return
    yield chunk, sum(read) - reported


def bench_tiktoken(text: Path, gpt2_dir: str, threads: int, max_mb: float) -> dict:
    """tiktoken's own rate on the chunks prepare tokenizes, in wall and CPU seconds of the encoding alone:
    `encode_ordinary_batch`, and on one thread also a plain loop of `encode_ordinary` (the batch call then
    only adds a thread pool's hand-offs); the faster is the baseline."""
    enc = GPT2Tokenizer(gpt2_dir).enc
    ways = {"encode_ordinary_batch": lambda texts: enc.encode_ordinary_batch(texts, num_threads=threads)}
    if threads == 1:
        ways["encode_ordinary loop"] = lambda texts: [enc.encode_ordinary(t) for t in texts]
    timings = {name: [0.0, 0.0] for name in ways}  # wall, CPU seconds (process_time: all threads)
    n_bytes = 0
    for chunk, read in chunks(text, max_mb * 1e6):
        n_bytes += read
        for name, encode in ways.items():
            t0, c0 = time.perf_counter(), time.process_time()
            encode(chunk)
            timings[name][0] += time.perf_counter() - t0
            timings[name][1] += time.process_time() - c0
    mb = n_bytes / 1e6  # MB of source text, as for prepare
    rates = {name: {"mb_per_s": mb / wall, "mb_per_cpu_s": mb / cpu} for name, (wall, cpu) in timings.items()}
    for name, r in rates.items():
        print(
            f"tiktoken {name}, {threads} thread{'s' * (threads > 1)} ({mb:,.0f} MB): {r['mb_per_s']:.2f} MB/s, "
            f"{r['mb_per_cpu_s']:.2f} MB per CPU-second",
            flush=True,
        )
    return max(rates.values(), key=lambda r: r["mb_per_cpu_s"])


def compare(prepared: dict[int, dict], tiktoken: dict[int, dict]) -> None:
    """prepare against tiktoken per core (target: at least 80%): in wall time against tiktoken on as many
    threads (which a busy machine disturbs), and per CPU-second against tiktoken's best single thread (the
    work each core does, whatever else runs)."""
    best = tiktoken[1]["mb_per_cpu_s"]
    for workers, result in prepared.items():
        threads = min(workers, max(tiktoken))
        rate, own = result["mb_per_s"] / workers, tiktoken[threads]["mb_per_s"] / threads
        print(
            f"per core, {workers} worker{'s' * (workers > 1)}: prepare {rate:.2f} MB/s against tiktoken's "
            f"{own:.2f} on {threads} thread{'s' * (threads > 1)} = {rate / own:.0%}; per CPU-second "
            f"{result['mb_per_cpu_s']:.2f} MB against tiktoken's {best:.2f} on one thread = "
            f"{result['mb_per_cpu_s'] / best:.0%} (target: at least 80%)"
        )


def bench_loader(store: TokenStore, seq_len: int, batch: int, n_batches: int, **options) -> float:
    """Tokens/s through `train_iterator` (options: weights with a list of stores, window_start)."""
    it = train_iterator(store, seq_len, batch, seed=0, **options)
    for _ in range(20):
        next(it)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        x = next(it)
    seconds = time.perf_counter() - t0
    assert x.shape == (batch, seq_len + 1)
    return n_batches * batch * seq_len / seconds


def bench_training(steps: int, document_attention: bool = False) -> tuple[float, int, int]:
    """Train-step tokens/s of the cpu preset on random tokens (document attention builds its mask whatever
    the tokens, so its cost does not depend on where documents end)."""
    import jax

    from minigpt import sharding
    from minigpt.training.trainer import build, init_state, make_train_step, resolve_model

    cfg = get_preset("cpu")
    cfg = resolve_model(cfg, 4096, 0)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, document_attention=document_attention)
    )
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
            state, metrics = step_fn(state, make_batch(), steps + 3)  # the run's length, for the schedule
        jax.block_until_ready(metrics)
        batches = [make_batch() for _ in range(steps)]
        t0 = time.perf_counter()
        for b in batches:
            state, metrics = step_fn(state, b, steps + 3)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return steps * batch * cfg.grad_accum * seq_len / seconds, batch, seq_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", type=Path, default=SHARED / "tinystories" / "train.txt")
    p.add_argument("--val", type=Path, default=SHARED / "tinystories" / "valid.txt")
    p.add_argument(
        "--gb", type=float, help="instead of --text: a corpus of this many GB, built from the shared texts"
    )
    p.add_argument("--gpt2-dir", default=str(SHARED / "gpt2"))
    p.add_argument(
        "--workers", type=int, nargs="+", help="tokenize_workers values (default 0; --gb: 1 and all)"
    )
    p.add_argument("--tokenizers", nargs="+", help="default: gpt2 and bpe; with --gb, gpt2")
    p.add_argument(
        "--tiktoken-mb",
        type=float,
        default=512,
        help="tiktoken is timed on this much of the --gb corpus (which repeats a 16 MB mix of texts)",
    )
    p.add_argument("--loader-batches", type=int, default=2000)
    p.add_argument("--train-steps", type=int, default=10)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child)
        return
    cores = len(os.sched_getaffinity(0))
    workers = a.workers or ([1, cores] if a.gb else [0])
    tokenizers = a.tokenizers or (["gpt2"] if a.gb else ["gpt2", "bpe"])
    val = a.val if a.val and a.val.is_file() else None
    print(f"{cores} cores; load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])} (before)")
    with tempfile.TemporaryDirectory(prefix="bench_data_") as root:
        text = build_corpus(Path(root) / "corpus.txt", a.gb) if a.gb else a.text
        if not text.is_file():
            sys.exit(f"no text at {text}; pass --text PATH")
        stores, prepared = {}, {}
        for tokenizer in tokenizers:
            for w in workers:
                cfg = data_config(text, val, tokenizer, a.gpt2_dir, w, Path(root) / f"{tokenizer}-{w}")
                stores[tokenizer], result = bench_prepare(cfg)
                if tokenizer == "gpt2":
                    prepared[result["meta"]["build"]["workers"]] = result
        if a.gb and prepared:
            tiktoken = {t: bench_tiktoken(text, a.gpt2_dir, t, a.tiktoken_mb) for t in sorted({1, cores})}
            compare(prepared, tiktoken)
        store = stores.get("bpe") or next(iter(stores.values()))
        train_tps, batch, seq_len = bench_training(a.train_steps)
        loader_tps = bench_loader(store, seq_len, batch, a.loader_batches)
        mixture_tps = bench_loader([store, store], seq_len, batch, a.loader_batches, weights=[0.7, 0.3])
        document_tps = bench_loader(store, seq_len, batch, a.loader_batches, window_start="document")
        masked = [bench_training(a.train_steps, document_attention=m) for m in (True, False, True)]
        train_tps = max(train_tps, masked[1][0])  # best of two, taking turns with document attention
        masked_tps = max(masked[0][0], masked[2][0])
    ratio = loader_tps / train_tps
    name = f"({store.meta['tokenizer_identity']}, {batch} x {seq_len})"
    print(f"loader {name}: {loader_tps / 1e6:.2f} M tokens/s")
    print(f"loader, a mixture of two sources (0.7/0.3) {name}: {mixture_tps / 1e6:.2f} M tokens/s")
    print(f"loader, windows that start at documents {name}: {document_tps / 1e6:.2f} M tokens/s")
    print(f"training (cpu preset, vocab 4096, {batch} x {seq_len}): {train_tps / 1e3:.1f} k tokens/s")
    print(
        f"training with --model.document-attention: {masked_tps / 1e3:.1f} k tokens/s "
        f"({masked_tps / train_tps:.2f}x; best of two each, taking turns)"
    )
    print(f"loader / training = {ratio:.0f}x ({'ok' if ratio >= 20 else 'TOO SLOW'}: needs >= 20x)")
    print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])} (after)")


if __name__ == "__main__":
    main()
