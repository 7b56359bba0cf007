"""Encoding a corpus into a store's split files: chunks of records tokenized in this process or in worker
processes, and appended to their split's token and document-start files in the order they were read."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from minigpt.data import packing
from minigpt.data.chat import ExampleRecord, example_tokens
from minigpt.data.corpus import BLOCK_BYTES
from minigpt.data.saved_tokenizer import load_tokenizer
from minigpt.data.tokenizer import Tokenizer, check_bytes
from minigpt.runtime import files, interrupts

CHUNK_CHARS = 1 << 20
"""Text per unit of tokenizer work (one worker task)."""
AUTO_WORKERS_MIN_BYTES = 64 << 20
"""Below this much source text (4 times as much on 2 cores), worker processes cost more to start than they
save."""


_WORKER: dict = {}


def _worker_init(tokenizer_dir: str, dtype: str, parent: int, template_origin: str | None = None) -> None:
    """`parent` is the pool's process, passed in: a worker that starts after its parent was killed would read
    its new parent from os.getppid() and wait for it instead. `template_origin`: the chat template's own file,
    which errors name (the store's copy is what the worker reads)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the parent stops it
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker per core already
    os.environ["RAYON_NUM_THREADS"] = "1"
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    tok = load_tokenizer(tokenizer_dir)
    if template_origin is not None:
        tok.template_origin = template_origin  # type: ignore[attr-defined]
    _WORKER.update(tok=tok, table=tok.token_bytes(), dtype=np.dtype(dtype), threads=1)


def _exit_with(parent: int) -> None:
    """Leave once the parent is gone: a worker of a killed prepare (kill -9) would wait for work forever."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _encode_chunk(texts: list[str], begins: list[bool], ends: list[bool], w: dict | None = None) -> tuple:
    """Tokens of a chunk of records: the tokenizer's BOS (if it has one) before each document's first piece,
    end-of-text after its last; tokens per record; bytes."""
    w = w or _WORKER
    if texts and isinstance(texts[0], ExampleRecord):
        return _encode_examples(texts, w)
    tok = w["tok"]
    ids = tok.encode_batch(texts, num_threads=w["threads"], begins=begins)
    for i, (begin, end) in enumerate(zip(begins, ends, strict=True)):
        if begin and tok.bos_id is not None:
            ids[i] = [tok.bos_id, *ids[i]]
        if end:
            ids[i].append(tok.eot_id)
    counts = np.fromiter(map(len, ids), np.int64, len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), w["dtype"], int(counts.sum()))
    # Each document's dummy prefix (SentencePiece-style tokenizers: `metaspace`) is a token byte, not text.
    n_bytes = int(w["table"][tokens].sum(dtype=np.int64)) - len(tok.dummy) * sum(
        b and bool(t) for t, b in zip(texts, begins, strict=True)
    )
    check_bytes(n_bytes, sum(len(t.encode()) for t in texts))
    return tokens, counts, n_bytes


def _encode_examples(texts: list[str], w: dict) -> tuple:
    """Tokens of a chunk of examples through the chat template, flagged (`packing.flagged`): what `_encode_chunk`
    returns for text."""
    tok = w["tok"]
    template = w.get("template") or w.setdefault("template", tok.chat_template())
    examples = [example_tokens(json.loads(t), template, tok) for t in texts]
    counts = np.fromiter((len(e.ids) for e in examples), np.int64, len(examples))
    tokens = np.concatenate([packing.flagged(e.ids, e.assistant) for e in examples]).astype(w["dtype"])
    return tokens, counts, sum(int(tok.text_bytes(e.ids, opened=True, examples=True).sum()) for e in examples)


class SplitWriter:
    """Appends one split's tokens and document starts to disk as chunks come back, in submission order.
    Given `done`, the counts an interrupted build journaled, it cuts its files back to them and appends. Of a
    store of `examples`, it also counts the targets (the assistant's tokens) and the examples without one."""

    def __init__(
        self, directory: Path, split: str, dtype: np.dtype, done: dict | None = None, examples: bool = False
    ) -> None:
        self.directory, self.split, self.examples = directory, split, examples
        self.tokens, self.documents, self.text_bytes = (
            (done["tokens"], done["documents"], done["text_bytes"]) if done else (0, 0, 0)
        )
        self.targets, self.without_targets = (
            (done.get("targets", 0), done.get("without_targets", 0)) if done else (0, 0)
        )
        paths = directory / f"{split}.bin", directory / f"{split}.docs.tmp"
        if done:  # what was written after the journal was: redone from the journaled point on
            os.truncate(paths[0], self.tokens * dtype.itemsize)
            os.truncate(paths[1], self.documents * 8)
        self.bin, self.starts = (open(p, "ab" if done else "wb") for p in paths)  # noqa: SIM115 (finish)
        self.texts: list[str] = []
        self.begins: list[bool] = []
        self.ends: list[bool] = []
        self.chars = 0
        self.queued_bytes = 0  # of the records queued (UTF-8), plus one per document end (its end-of-text)
        self.in_flight: deque[int] = deque()  # queued_bytes of each chunk taken and not yet written

    def add(self, text: str, begins: bool, ends: bool) -> bool:
        """Queue a record; True when a chunk's worth is queued."""
        self.texts.append(text)
        self.begins.append(begins)
        self.ends.append(ends)
        self.chars += len(text)
        self.queued_bytes += (len(text) if text.isascii() else len(text.encode())) + ends
        return self.chars >= CHUNK_CHARS

    def take(self) -> tuple[list[str], list[bool], list[bool]]:
        out = (self.texts, self.begins, self.ends)
        if self.texts:  # a chunk that Encoder.submit will write
            self.in_flight.append(self.queued_bytes)
        self.texts, self.begins, self.ends, self.chars, self.queued_bytes = [], [], [], 0, 0
        return out

    def pending_bytes(self) -> int:
        """Bytes of the records added and not yet written: at least the tokens they will make."""
        return self.queued_bytes + sum(self.in_flight)

    def write(self, begins: list[bool], tokens: np.ndarray, counts: np.ndarray, n_bytes: int) -> None:
        offsets = self.tokens + np.cumsum(counts) - counts
        starts = offsets[np.asarray(begins, bool)]
        starts.astype(np.int64).tofile(self.starts)
        tokens.tofile(self.bin)
        self.in_flight.popleft()
        self.tokens += len(tokens)
        self.documents += len(starts)
        self.text_bytes += n_bytes
        if self.examples:  # each record one example, never cut: its tokens are counts[i] in a row
            ends = np.cumsum(counts)  # a target: neither MASKED nor an example's first token
            targets = np.concatenate([[0], np.cumsum((tokens & (packing.MASKED | packing.START)) == 0)])
            per_example = targets[ends] - targets[ends - counts]
            self.targets += int(per_example.sum())
            self.without_targets += int((per_example == 0).sum())

    def counts(self) -> dict:
        out = {"documents": self.documents, "tokens": self.tokens, "text_bytes": self.text_bytes}
        return out | (
            {"targets": self.targets, "without_targets": self.without_targets} if self.examples else {}
        )

    def flush(self) -> None:
        self.bin.flush()
        self.starts.flush()

    def finish(self) -> dict:
        """Close the files and write the document starts as .npy (copied in blocks: flat memory). The raw
        starts stay until the store is complete: the journal still counts on them until then."""
        self.bin.close()
        self.starts.close()
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.int64)), "fortran_order": False}
        with (
            open(self.directory / f"{self.split}.docs.tmp", "rb") as raw,
            files.atomic_open(self.directory / f"{self.split}.docs.npy", "wb") as out,
        ):
            np.lib.format.write_array_header_1_0(out, {**header, "shape": (self.documents,)})
            shutil.copyfileobj(raw, out, BLOCK_BYTES)
        return self.counts()


class Encoder:
    """Runs chunks through the tokenizer, here or in worker processes, and hands results to their writer in
    submission order; at most a few chunks are in flight, so memory stays bounded."""

    def __init__(self, tok: Tokenizer, tokenizer_dir: Path, dtype: np.dtype, workers: int) -> None:
        # In this process: the tokenizer's own threads, except on 2 cores, where one thread is faster.
        threads = 1 if usable_cores() <= 2 else None
        self.local = {"tok": tok, "table": tok.token_bytes(), "dtype": dtype, "threads": threads}
        self.pool = None
        if workers > 1:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),  # no fork: the parent may run JAX threads
                initializer=_worker_init,
                initargs=(str(tokenizer_dir), dtype.name, os.getpid(), getattr(tok, "template_origin", None)),
            )
        self.max_in_flight = 2 * workers + 1
        self.in_flight: deque = deque()

    def submit(self, writer: SplitWriter) -> None:
        texts, begins, ends = writer.take()
        if not texts:
            return
        if self.pool is None:
            writer.write(begins, *_encode_chunk(texts, begins, ends, self.local))
            return
        with interrupts.sparing_children():  # the pool starts its workers as chunks come
            future = self.pool.submit(_encode_chunk, texts, begins, ends)
        self.in_flight.append(lambda: writer.write(begins, *future.result()))
        while len(self.in_flight) >= self.max_in_flight:
            self.in_flight.popleft()()

    def after(self, callback: Callable[[], None]) -> None:
        """Call `callback` once every chunk submitted so far is written, and none submitted later."""
        if self.in_flight:
            self.in_flight.append(callback)
        else:
            callback()

    def drain(self) -> None:
        while self.in_flight:
            self.in_flight.popleft()()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def usable_cores() -> int:
    """The cores this process may run on: its affinity, which a container or taskset can narrow."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_workers(requested: int, total_bytes: int) -> int:
    """Worker processes to tokenize `total_bytes` of text with: `requested`, or as many as repay starting."""
    if requested:
        return requested
    # Workers take seconds to start (each imports minigpt and loads the tokenizer) and gain at most `cores`
    # times, so on 2 cores only a large corpus repays them.
    cores = usable_cores()
    if cores == 1 or total_bytes < AUTO_WORKERS_MIN_BYTES * (4 if cores == 2 else 1):
        return 1
    return min(cores, 32)
