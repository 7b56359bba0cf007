"""Data pipeline throughput: how fast text becomes tokens, and whether the loader keeps up with training.

    python benchmarks/bench_data.py [--text PATH] [--gpt2-dir DIR] [--workers 0 1 2]
    python benchmarks/bench_data.py --gb 2                  # a 2 GB corpus, 1 worker and one per core
    python benchmarks/bench_data.py --quick                 # TinyStories' validation text, a few batches

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
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common import SHARED, need, parser, print_tables, report, run_child, table, write_result

from minigpt.config import DataConfig, get_preset
from minigpt.data.build import prepare
from minigpt.data.corpus import FileStats, read_records
from minigpt.data.encode import CHUNK_CHARS
from minigpt.data.loader import train_iterator
from minigpt.data.store import TokenStore
from minigpt.data.tokenizer import EOT, GPT2Tokenizer


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
    result, why = run_child([__file__, "--child", json.dumps(dataclasses.asdict(cfg))])
    if result is None:
        sys.exit(f"prepare failed: {why}")
    t0 = time.perf_counter()
    store = prepare(cfg)
    cached = time.perf_counter() - t0
    meta, seconds = result["meta"], result["seconds"]
    mb = sum(f["size"] for s in meta["sources"].values() for f in s) / 1e6
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    result |= {
        "mb": mb,
        "mb_per_s": mb / seconds,
        "mb_per_cpu_s": mb / result["cpu_seconds"],
        "tokens": tokens,
    }
    result |= {"tokenizer": cfg.tokenizer, "workers": meta["build"]["workers"], "cached_s": cached}
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
    from minigpt.tools.bench import compile_step, time_steps
    from minigpt.training.trainer import resolve_model

    cfg = resolve_model(get_preset("cpu"), 4096, 0)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, document_attention=document_attention)
    )
    times, _ = time_steps(compile_step(cfg), 2, steps)
    return cfg.tokens_per_step * steps / sum(times), cfg.batch_size, cfg.data.seq_len


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
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
    if a.quick:
        a.text, a.val, a.gb, a.loader_batches, a.train_steps = a.val, None, None, 50, 1
    return a


def measure(a: argparse.Namespace, root: Path) -> dict:
    """Prepare throughput per tokenizer and worker count, then the loader against training."""
    cores = len(os.sched_getaffinity(0))
    workers = a.workers or ([1, cores] if a.gb else [0])
    tokenizers = a.tokenizers or (["gpt2"] if a.gb else ["gpt2", "bpe"])
    text = build_corpus(root / "corpus.txt", a.gb) if a.gb else a.text
    val = a.val if a.val and a.val.is_file() else None
    stores, prepared = {}, []
    for tokenizer in tokenizers:
        for w in workers:
            cfg = data_config(text, val, tokenizer, a.gpt2_dir, w, root / f"{tokenizer}-{w}")
            stores[tokenizer], result = bench_prepare(cfg)
            prepared.append(result)
    gpt2 = {r["workers"]: r for r in prepared if r["tokenizer"] == "gpt2"}
    if a.gb and gpt2:
        compare(gpt2, {t: bench_tiktoken(text, a.gpt2_dir, t, a.tiktoken_mb) for t in sorted({1, cores})})
    store = stores.get("bpe") or next(iter(stores.values()))
    train_tps, batch, seq_len = bench_training(a.train_steps)
    rates = {
        "loader": bench_loader(store, seq_len, batch, a.loader_batches),
        "loader, a mixture of two sources (0.7/0.3)": bench_loader(
            [store, store], seq_len, batch, a.loader_batches, weights=[0.7, 0.3]
        ),
        "loader, windows that start at documents": bench_loader(
            store, seq_len, batch, a.loader_batches, window_start="document"
        ),
    }
    if a.quick:
        rates["training (cpu preset)"] = train_tps
        return {"prepared": prepared, "rates": rates, "batches": f"{batch} x {seq_len}"}
    timed = [(m, bench_training(a.train_steps, document_attention=m)[0]) for m in (True, False, True)]
    rates["training (cpu preset)"] = max([train_tps] + [tps for m, tps in timed if not m])  # best of two
    rates["training with --model.document-attention"] = max(tps for m, tps in timed if m)
    name = f"{store.meta['tokenizer_identity']}, {batch} x {seq_len}"
    return {"prepared": prepared, "rates": rates, "batches": name}


def tables(r: dict) -> list[dict]:
    rows = [
        [p["tokenizer"], p["workers"], f"{p['mb']:,.1f}", f"{p['seconds']:.1f}", f"{p['mb_per_s']:.2f}",
         f"{p['mb_per_cpu_s']:.2f}", f"{p['tokens'] / p['seconds'] / 1e6:.2f}",
         f"{p['peak_rss_bytes'] / 2**20:,.0f}", f"{p['workers_peak_rss_bytes'] / 2**20:,.0f}",
         f"{p['cached_s'] * 1e3:.0f}"]
        for p in r["prepared"]
    ]  # fmt: skip
    columns = ["tokenizer", "workers", "MB", "s", "MB/s", "MB per CPU-s", "M tokens/s", "peak RSS MiB",
               "largest worker MiB", "cached re-run ms"]  # fmt: skip
    prepare = table(columns, rows, "Preparing the corpus into a fresh token cache (BPE training included)")
    rates = r["rates"]
    ratio = rates["loader"] / rates["training (cpu preset)"]
    rows = [[what, f"{tps:,.0f}"] for what, tps in rates.items()]
    note = (
        f"Loader / training = {ratio:,.0f}x (needs >= 20x). Training: best of two, taking turns with and "
        "without document attention."
    )
    return [prepare, table(["what", "tokens/s"], rows, f"The loader against training ({r['batches']})", note)]


def main() -> None:
    a = parse_args()
    if a.child:
        child(a.child)
        return
    if not a.gb:
        need(a.text, Path(a.gpt2_dir))
    with tempfile.TemporaryDirectory(prefix="bench_data_") as root:
        r = measure(a, Path(root))
    out = tables(r)
    print_tables(out)
    ratio = r["rates"]["loader"] / r["rates"]["training (cpu preset)"]
    headlines = [f"The loader delivers {ratio:,.0f}x the tokens/s the cpu preset trains on"]
    write_result(a, "bench_data", "Data pipeline throughput", out, headlines=headlines, data=r)


if __name__ == "__main__":
    main()
