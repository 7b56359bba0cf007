"""The token store: a corpus tokenized once, streamed to disk, and reused while its sources are unchanged.

Documents from `minigpt.corpus` are tokenized chunk by chunk (in worker processes on machines with cores to
spare), so no step holds the corpus's tokens in memory, and written per split as a flat token file with an
end-of-text token after each document, the documents' start offsets and meta.json. The trained BPE sees only
the first `bpe_train_bytes` of training text. Without validation files, a deterministic `val_fraction` of
documents (by content hash) is held out for validation; validation files that are the training text are
refused, and ones whose documents mostly occur in the training text are warned about.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from minigpt import files
from minigpt.config import ConfigError, DataConfig
from minigpt.corpus import (
    BLOCK_BYTES,
    DataWarning,
    FileStats,
    download_tinystories,
    file_warnings,
    os_reason,
    read_records,
    resolve_files,
)
from minigpt.tokenizer import BPETokenizer, GPT2Tokenizer, Tokenizer, find_gpt2_files, load_tokenizer

STORE_VERSION = 2
"""The store layout's version: a store of another version is rebuilt."""
CHUNK_CHARS = 1 << 20
"""Text per unit of tokenizer work (one worker task)."""
AUTO_WORKERS_MIN_BYTES = 64 << 20
"""Below this much source text, worker processes cost more to start than they save."""
OVERLAP_MAX_DOCS = 500_000
"""Validation documents are looked up in the training text if there are at most this many (each costs some
80 bytes of memory while tokenizing)."""


@dataclasses.dataclass(frozen=True)
class TokenStore:
    """A prepared corpus on disk: `{split}.bin` token arrays, `{split}.docs.npy` document starts, meta.json."""

    path: Path
    meta: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens as a read-only memory map: nothing is loaded until it is indexed."""
        return np.memmap(self.path / f"{split}.bin", dtype=self.dtype, mode="r")

    def doc_starts(self, split: str) -> np.ndarray:
        return np.load(self.path / f"{split}.docs.npy", mmap_mode="r")

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.path / "tokenizer")

    def opening(self, split: str, words: int = 6) -> str:
        """The first `words` words of the split's first document that has any: a prompt in the corpus's own
        style (a story's opening for TinyStories, a sentence of a book for Gutenberg)."""
        tokens, starts, tok = self.tokens(split), self.doc_starts(split), self.tokenizer()
        ends = [*starts[1:], len(tokens)]
        for start, end in zip(starts[:64], ends[:64], strict=False):
            stop = min(end, start + 16 * words)
            found = tok.decode(np.asarray(tokens[start:stop]).tolist()).replace("<|endoftext|>", " ").split()
            if found:  # a document cut short may end in part of a word
                return " ".join(found[: words if stop == end else min(words, len(found) - 1)] or found[:1])
        return ""

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def identity(self) -> str:
        """What the tokens are made of: each source file's content hash, the tokenizer's files and the
        reading options. Two stores with one identity hold the same tokens, wherever they are."""
        made_of = {
            "sources": {s: [f["sha256"] for f in self.meta["sources"][s]] for s in ("train", "val")},
            "tokenizer": self.meta["tokenizer"]["files"],
            "options": self.meta["options"],
        }
        return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:16]

    def check_unchanged(self) -> None:
        """Refuse to read on if another process rebuilt this store since it was opened (the same data path,
        prepared again after a source file changed): the tokens on disk are no longer these."""
        try:
            now = TokenStore(self.path, json.loads((self.path / "meta.json").read_text())).identity
        except (OSError, ValueError, KeyError):
            now = None
        if now != self.identity:
            raise ConfigError(
                f"token store {self.path} was rebuilt by another process while this run used it (a source file "
                "changed); stopping rather than read other tokens: restore the original files to resume, or "
                "start a new run on the new data"
            )


class _Router:
    """Holds out a deterministic val_fraction of documents by content hash (so a duplicated document lands
    in one split only); the first document always goes to validation, so it is never empty."""

    def __init__(self, fraction: float | None) -> None:
        self.threshold = None if fraction is None else int(fraction * 2**64)
        self.first = True

    def __call__(self, text: str) -> str:
        if self.threshold is None:
            return "train"
        if self.first:
            self.first = False
            return "val"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return "val" if int.from_bytes(digest, "little") < self.threshold else "train"


# ------------------------------------------------------------------------------------------- tokenizing

_WORKER: dict = {}


def _worker_init(tokenizer_dir: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker per core already
    os.environ["RAYON_NUM_THREADS"] = "1"
    tok = load_tokenizer(tokenizer_dir)
    _WORKER.update(tok=tok, table=tok.token_bytes(), dtype=np.dtype(dtype), threads=1)


def _encode_chunk(texts: list[str], ends: list[bool], w: dict | None = None) -> tuple:
    """Tokens of a chunk of records, end-of-text after each document's last piece; tokens per record; bytes."""
    w = w or _WORKER
    ids = w["tok"].encode_batch(texts, num_threads=w["threads"])
    eot = w["tok"].eot_id
    for x, end in zip(ids, ends, strict=True):
        if end:
            x.append(eot)
    counts = np.fromiter(map(len, ids), np.int64, len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), w["dtype"], int(counts.sum()))
    return tokens, counts, int(w["table"][tokens].sum(dtype=np.int64))


class _SplitWriter:
    """Appends one split's tokens and document starts to disk as chunks come back, in submission order."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype) -> None:
        self.directory, self.split = directory, split
        self.bin = open(directory / f"{split}.bin", "wb")  # noqa: SIM115 (closed in finish)
        self.starts = open(directory / f"{split}.docs.tmp", "wb")  # noqa: SIM115
        self.texts: list[str] = []
        self.begins: list[bool] = []
        self.ends: list[bool] = []
        self.chars = 0
        self.tokens = self.documents = self.text_bytes = 0

    def add(self, text: str, begins: bool, ends: bool) -> bool:
        """Queue a record; True when a chunk's worth is queued."""
        self.texts.append(text)
        self.begins.append(begins)
        self.ends.append(ends)
        self.chars += len(text)
        return self.chars >= CHUNK_CHARS

    def take(self) -> tuple[list[str], list[bool], list[bool]]:
        out = (self.texts, self.begins, self.ends)
        self.texts, self.begins, self.ends, self.chars = [], [], [], 0
        return out

    def write(self, begins: list[bool], tokens: np.ndarray, counts: np.ndarray, n_bytes: int) -> None:
        offsets = self.tokens + np.cumsum(counts) - counts
        starts = offsets[np.asarray(begins, bool)]
        starts.astype(np.int64).tofile(self.starts)
        tokens.tofile(self.bin)
        self.tokens += len(tokens)
        self.documents += len(starts)
        self.text_bytes += n_bytes

    def finish(self) -> dict:
        self.bin.close()
        self.starts.close()
        raw = self.directory / f"{self.split}.docs.tmp"
        out = np.lib.format.open_memmap(
            self.directory / f"{self.split}.docs.npy", "w+", np.int64, (self.documents,)
        )
        if self.documents:
            out[:] = np.memmap(raw, np.int64, "r")
        out.flush()
        del out
        raw.unlink()
        return {"documents": self.documents, "tokens": self.tokens, "text_bytes": self.text_bytes}


class _Encoder:
    """Runs chunks through the tokenizer, here or in worker processes, and hands results to their writer in
    submission order; at most a few chunks are in flight, so memory stays bounded."""

    def __init__(self, tok: Tokenizer, tokenizer_dir: Path, dtype: np.dtype, workers: int) -> None:
        # In this process: the tokenizer's own threads, except on 2 cores, where one thread measured faster.
        threads = 1 if _cores() <= 2 else None
        self.local = {"tok": tok, "table": tok.token_bytes(), "dtype": dtype, "threads": threads}
        self.pool = None
        if workers > 1:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),  # no fork: the parent may run JAX threads
                initializer=_worker_init,
                initargs=(str(tokenizer_dir), dtype.name),
            )
        self.max_in_flight = 2 * workers + 1
        self.in_flight: deque = deque()

    def submit(self, writer: _SplitWriter) -> None:
        texts, begins, ends = writer.take()
        if not texts:
            return
        if self.pool is None:
            writer.write(begins, *_encode_chunk(texts, ends, self.local))
            return
        self.in_flight.append((writer, begins, self.pool.submit(_encode_chunk, texts, ends)))
        while len(self.in_flight) >= self.max_in_flight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        writer, begins, future = self.in_flight.popleft()
        writer.write(begins, *future.result())

    def drain(self) -> None:
        while self.in_flight:
            self._complete_oldest()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _auto_workers(requested: int, total_bytes: int) -> int:
    if requested:
        return requested
    # Measured on 2 cores: worker processes gain nothing there, and cost seconds to start.
    if _cores() <= 2 or total_bytes < AUTO_WORKERS_MIN_BYTES:
        return 1
    return min(_cores(), 32)


# ------------------------------------------------------------------------------------------ token store


def sha256_of(*paths: Path) -> str:
    """sha256 (hex) of the files' bytes, one after another."""
    h = hashlib.sha256()
    for path in paths:
        try:
            with open(path, "rb") as f:
                while block := f.read(BLOCK_BYTES):
                    h.update(block)
        except OSError as e:
            raise ConfigError(f"{path} could not be read ({os_reason(e)})") from None
    return h.hexdigest()


def _stat(path: Path) -> dict:
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"{path} could not be read ({os_reason(e)})") from None
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _tokenizer_request(cfg: DataConfig) -> str:
    return "gpt2" if cfg.tokenizer == "gpt2" else f"bpe{cfg.bpe_vocab_size}"


def _files_hashes(directory: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir()) if f.is_file()
    }


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock, so processes (hosts sharing a cache, parallel runs) never build one store twice."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _reusable(store: Path, request: str, sources: dict[str, list[dict]]) -> dict | None:
    """The store's meta if it is complete, made by the requested tokenizer and from unchanged sources."""
    meta_path = store / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None  # absent, or half-written (killed mid-prepare: meta.json is written last)
    if not meta.get("complete") or meta.get("version") != STORE_VERSION or "tokenizer" not in meta:
        return None
    tok_meta = meta["tokenizer"]
    if tok_meta["request"] != request:
        raise ConfigError(
            f"token store {store} holds tokens of tokenizer {tok_meta['identity']}, but the config asks for "
            f"{request}; delete the folder to rebuild it"
        )
    try:
        tokenizer_files = _files_hashes(store / "tokenizer")
    except OSError:
        tokenizer_files = {}
    if tokenizer_files != tok_meta["files"]:
        raise ConfigError(
            f"token store {store}: tokenizer/ is not the tokenizer its tokens were made with "
            f"({tok_meta['identity']}); delete the folder to rebuild it"
        )
    old = meta["sources"]
    if _same_files(old, sources, ("path", "size", "mtime_ns")):
        return meta
    if _same_files(old, sources, ("path", "size")):
        # Touched but maybe not changed (a copy, a checkout): compare contents before re-tokenizing.
        old_hashes = [f["sha256"] for s in ("train", "val") for f in old[s]]
        new_files = [Path(f["path"]) for s in ("train", "val") for f in sources[s]]
        if old_hashes == [sha256_of(f) for f in new_files]:
            for s in ("train", "val"):
                for o, n in zip(old[s], sources[s], strict=True):
                    o["mtime_ns"] = n["mtime_ns"]
            files.write_json(meta_path, meta)
            return meta
    print(f"sources changed since {store} was built: tokenizing again")
    return None


def _same_files(a: dict, b: dict, keys: tuple[str, ...]) -> bool:
    pick = lambda sources: [[tuple(f[k] for k in keys) for f in sources[s]] for s in ("train", "val")]
    return pick(a) == pick(b)


def prepare(cfg: DataConfig) -> TokenStore:
    """Tokenize the corpus once into a cached token store; reuse it while sources and tokenizer are unchanged.

    The store's folder is named by what was asked for (source paths as given, tokenizer, reading options);
    its meta.json records what was found (each file's size, mtime and sha256). A later call with the same
    request reuses the store if every file still has its size and mtime (or, if only mtimes moved, its
    sha256), and otherwise rebuilds it in place."""
    train_paths, val_paths = cfg.paths, cfg.val_paths
    if not train_paths:
        train_paths, hub_val = download_tinystories()
        val_paths = val_paths or hub_val
    train_files, val_files = resolve_files(train_paths), resolve_files(val_paths, "--val-data")
    both = set(train_files) & set(val_files)
    if both:
        raise ConfigError(f"{sorted(both)[0]} is both training and validation data")
    request = _tokenizer_request(cfg)
    options = {
        "separator": cfg.separator,
        "text_field": cfg.text_field,
        "encoding_errors": cfg.encoding_errors,
        "val_fraction": None if val_files else cfg.val_fraction,
        "bpe_train_bytes": cfg.bpe_train_bytes if cfg.tokenizer == "bpe" else None,
    }
    key_src = {
        "version": STORE_VERSION,
        "train": [str(Path(p).expanduser().absolute()) for p in train_paths],
        "val": [str(Path(p).expanduser().absolute()) for p in val_paths],
        "tokenizer": request,
        "options": options,
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cfg.cache_dir).expanduser() / "tokens"
    store = root / key
    sources = {"train": [_stat(f) for f in train_files], "val": [_stat(f) for f in val_files]}
    with _locked(root / f"{key}.lock"):
        meta = _reusable(store, request, sources)
        if meta is not None:
            return TokenStore(store, meta)
        tmp = root / f"{key}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            meta = _build(tmp, cfg, train_files, val_files, sources, request, options)
        except OSError as e:  # reading errors are ConfigErrors already: this is the store's own disk
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(
                f"could not write the token store under {root} ({os_reason(e)}; a full disk?); free some space "
                "or pass another --data.cache-dir"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(store, ignore_errors=True)
        os.replace(tmp, store)
    return TokenStore(store, meta)


def _bpe_sample(cfg: DataConfig, train_files: list[Path], has_val: bool) -> Iterator[str]:
    """The first bpe_train_bytes of training documents (as routed by the full pass), in order."""
    route, budget = _Router(None if has_val else cfg.val_fraction), cfg.bpe_train_bytes
    split = "train"
    for path in train_files:
        with contextlib.closing(read_records(path, cfg, FileStats())) as records:
            for text, begins, _ in records:
                if begins:
                    split = route(text)
                if split == "train":
                    yield text
                    budget -= len(text)
                    if budget <= 0:
                        return


def _check_counts(train_files: list[Path], val_files: list[Path], documents: dict[str, int]) -> None:
    if not val_files and documents["val"] + documents["train"] == 1:
        raise ConfigError("need at least 2 documents to hold some out for validation, or pass --val-data")
    if documents["train"] == 0:
        if not val_files and documents["val"]:
            raise ConfigError(
                f"training corpus is empty: all {documents['val']} documents were held out for validation; "
                "pass --val-data or lower --data.val-fraction"
            )
        raise ConfigError(f"training corpus is empty: no text in {', '.join(map(str, train_files))}")
    if val_files and documents["val"] == 0:
        raise ConfigError(f"validation corpus is empty: no text in {', '.join(map(str, val_files))}")


def _build(
    directory: Path,
    cfg: DataConfig,
    train_files: list[Path],
    val_files: list[Path],
    sources: dict[str, list[dict]],
    request: str,
    options: dict,
) -> dict:
    """Tokenize the sources into a store in `directory`; meta.json, written last, marks it complete."""
    started = time.time()
    _refuse_same_text(train_files, val_files, sources)
    tok = _make_tokenizer(cfg, train_files, val_files)
    tok.save(directory / "tokenizer")
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    total = sum(f["size"] for s in sources.values() for f in s)
    workers = _auto_workers(cfg.tokenize_workers, total)
    writers = {s: _SplitWriter(directory, s, dtype) for s in ("train", "val")}
    encoder = _Encoder(tok, directory / "tokenizer", dtype, workers)
    try:
        with tqdm(total=total, desc="tokenize", unit="B", unit_scale=True, leave=False) as bar:
            notes = _tokenize(
                cfg, {"train": train_files, "val": val_files}, sources, writers, encoder, bar.update
            )
    finally:
        encoder.close()
    for note in notes:  # after the progress bar is gone; pointing at prepare's caller
        warnings.warn(note, DataWarning, stacklevel=3)
    splits = {s: w.finish() for s, w in writers.items()}
    _check_counts(train_files, val_files, {s: splits[s]["documents"] for s in splits})
    meta = {
        "version": STORE_VERSION,
        "complete": True,
        "sources": sources,
        "options": options,
        "tokenizer": {
            "request": request,
            "identity": tok.identity,
            "vocab_hash": tok.vocab_hash,
            "files": _files_hashes(directory / "tokenizer"),
        },
        "tokenizer_identity": tok.identity,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "splits": splits,
        "build": {"seconds": round(time.time() - started, 2), "workers": workers},
        "warnings": notes,
    }
    files.write_json(directory / "meta.json", meta)
    return meta


def _refuse_same_text(train_files: list[Path], val_files: list[Path], sources: dict[str, list[dict]]) -> None:
    """Refuse validation files whose bytes, one after another, are the training files' (a copy, a hard link):
    hashed only when the sizes add up to the same."""
    sizes = {s: sum(f["size"] for f in sources[s]) for s in ("train", "val")}
    if not val_files or sizes["train"] != sizes["val"]:
        return
    if sha256_of(*train_files) == sha256_of(*val_files):
        raise ConfigError(
            f"the validation text ({', '.join(map(str, val_files))}) is the same as the training text; "
            "pass other --val-data, or none to hold out --data.val-fraction of the training documents"
        )


class _Overlap:
    """Which validation documents also occur in the training text, by an 8-byte hash of each whole document.
    Validation files are read first; off if there are none, or more than OVERLAP_MAX_DOCS documents."""

    def __init__(self, active: bool) -> None:
        self.val: set[bytes] | None = set() if active else None
        self.found: set[bytes] = set()
        self.hash = None

    def add(self, split: str, text: str, begins: bool, ends: bool) -> None:
        if self.val is None:
            return
        if begins:  # once every validation document was found, training documents need no hashing
            done = split == "train" and len(self.found) == len(self.val)
            self.hash = None if done else hashlib.blake2b(digest_size=8)
        if self.hash is None:
            return
        self.hash.update(text.encode())
        if ends:
            digest = self.hash.digest()
            if split == "val":
                self.val.add(digest)
                if len(self.val) > OVERLAP_MAX_DOCS:
                    self.val = None
            elif digest in self.val:
                self.found.add(digest)

    def note(self, val_files: list[Path]) -> list[str]:
        """A warning when at least half of the validation documents occur in the training text."""
        if not self.val or 2 * len(self.found) < len(self.val):
            return []
        return [
            f"{len(self.found):,} of {len(self.val):,} validation documents (in "
            f"{', '.join(map(str, val_files))}) also occur in the training text: the validation loss will "
            "flatter the model; hold out documents that are not trained on"
        ]


def _make_tokenizer(cfg: DataConfig, train_files: list[Path], val_files: list[Path]) -> Tokenizer:
    """GPT-2's BPE, or a byte-level BPE trained on the first bpe_train_bytes of training text."""
    if cfg.tokenizer == "gpt2":
        return GPT2Tokenizer(find_gpt2_files(cfg.gpt2_dir))
    print(
        f"training a {cfg.bpe_vocab_size}-token byte-level BPE on (at most) the first "
        f"{cfg.bpe_train_bytes / 1e6:g} MB of training text"
    )
    sample = _bpe_sample(cfg, train_files, bool(val_files))
    first = next(sample, None)
    if first is None:  # no training text at all, or every document held out: say which
        n = sum(ends for f in train_files for _, _, ends in read_records(f, cfg, FileStats()))
        _check_counts(train_files, val_files, {"train": 0, "val": 0 if val_files else n})
    return BPETokenizer.train(itertools.chain([first], sample), cfg.bpe_vocab_size)


def _tokenize(
    cfg: DataConfig,
    files: dict[str, list[Path]],
    sources: dict[str, list[dict]],
    writers: dict[str, _SplitWriter],
    encoder: _Encoder,
    advance: Callable[[int], None],
) -> list[str]:
    """Read every source file once, routing its documents to a split's writer and tokenizing them as chunks
    fill up; records each file's sha256 and document count in `sources`; returns the files' warnings.

    Validation files go to "val" whole; without them, `val_fraction` of the training documents do."""
    notes: list[str] = []
    overlap = _Overlap(bool(files["val"]))
    for split in ("val", "train"):  # validation first: its documents are then looked up in the training text
        route = _Router(None if split == "val" or files["val"] else cfg.val_fraction)
        for i, path in enumerate(files[split]):
            sources[split][i]["sha256"] = sha256_of(path)
            stats = FileStats()
            target = writers[split]
            for text, begins, ends in read_records(path, cfg, stats, advance):
                if begins and split == "train":
                    target = writers[route(text)]
                overlap.add(split, text, begins, ends)
                if target.add(text, begins, ends):
                    encoder.submit(target)
            sources[split][i]["documents"] = stats.documents
            notes += file_warnings(path, stats)
    for w in writers.values():
        encoder.submit(w)
    encoder.drain()
    return notes + overlap.note(files["val"])
