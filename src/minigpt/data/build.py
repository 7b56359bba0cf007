"""Building a token store: the corpus tokenized chunk by chunk and streamed to disk, resumable after a kill.

Documents from `minigpt.data.corpus` are tokenized chunk by chunk (in worker processes on machines with cores to
spare, see `minigpt.data.encode`), so no step holds the corpus's tokens in memory, and written per split in the
layout `minigpt.data.store` reads. The trained BPE sees only the first `bpe_train_bytes` of training text.
Without validation files, a deterministic `val_fraction` of documents (by content hash) is held out for
validation; validation files that are the training text are refused, and ones whose documents mostly occur in
the training text are warned about. A build journals how far it got every few seconds, so one that is
interrupted (kill -9, Ctrl-C, a lost machine) continues from there, to the same store an uninterrupted build
makes (see `_Pass`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from minigpt import files
from minigpt.config import ConfigError, DataConfig
from minigpt.data import hub
from minigpt.data.corpus import (
    DataWarning,
    FileStats,
    download_tinystories,
    file_warnings,
    os_reason,
    read_records,
    resolve_files,
)
from minigpt.data.encode import Encoder, SplitWriter, auto_workers
from minigpt.data.store import STORE_VERSION, TokenStore, files_hashes, reusable, same_files, sha256_of
from minigpt.data.tokenizer import BPETokenizer, GPT2Tokenizer, Tokenizer, find_gpt2_files, load_tokenizer

JOURNAL_SECONDS = 5.0
"""How often (at most) an interrupted build's journal is brought up to date: about the work a kill loses."""
PROGRESS_SECONDS = 15.0
"""How often progress is printed where there is no terminal for a progress bar."""
OVERLAP_MAX_DOCS = 500_000
"""Validation documents are looked up in the training text if there are at most this many (each costs some
80 bytes of memory while tokenizing)."""


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


def _stat(path: Path) -> dict:
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"{path} could not be read ({os_reason(e)})") from None
    entry = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if isinstance(path, hub.HubFile) and path.remote is not None:  # pinned to a commit: it cannot change
        entry["hub"] = f"{path.remote.repo_id}@{path.remote.sha}"
    return entry


def _tokenizer_request(cfg: DataConfig) -> str:
    return "gpt2" if cfg.tokenizer == "gpt2" else f"bpe{cfg.bpe_vocab_size}"


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


def prepare(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> TokenStore:
    """Tokenize the corpus once into a cached token store; reuse it while sources and tokenizer are unchanged.

    The store's folder is named by what was asked for (source paths as given, tokenizer, reading options);
    its meta.json records what was found (each file's size, mtime and sha256). A later call with the same
    request reuses the store if every file still has its size and mtime (or, if only mtimes moved, its
    sha256), and otherwise rebuilds it in place. `tokenizer`, if given, is used instead of the one the
    config asks for (the sources of a mixture share one)."""
    train_paths, val_paths = cfg.paths, cfg.val_paths
    if not train_paths:
        train_paths, hub_val = download_tinystories()
        val_paths = val_paths or hub_val
    train_files, val_files = resolve_files(train_paths), resolve_files(val_paths, "--val-data")
    both = set(train_files) & set(val_files)
    if both:
        raise ConfigError(f"{sorted(both)[0]} is both training and validation data")
    request = _tokenizer_request(cfg) if tokenizer is None else f"shared-{tokenizer.identity}"
    options = {
        "separator": cfg.separator,
        "text_field": cfg.text_field,
        "encoding_errors": cfg.encoding_errors,
        "val_fraction": None if val_files else cfg.val_fraction,
        "bpe_train_bytes": cfg.bpe_train_bytes if cfg.tokenizer == "bpe" else None,
    }
    key_src = {
        "version": STORE_VERSION,
        "train": [p if hub.is_spec(p) else str(Path(p).expanduser().absolute()) for p in train_paths],
        "val": [p if hub.is_spec(p) else str(Path(p).expanduser().absolute()) for p in val_paths],
        "tokenizer": request,
        "options": options,
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cfg.cache_dir).expanduser() / "tokens"
    store = root / key
    sources = {"train": [_stat(f) for f in train_files], "val": [_stat(f) for f in val_files]}
    with _locked(root / f"{key}.lock"):
        meta = reusable(store, request, sources)
        if meta is not None:
            return TokenStore(store, meta)
        tmp = root / f"{key}.tmp"  # kept if interrupted (a kill, Ctrl-C): the next call continues it
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            meta = _build(tmp, cfg, train_files, val_files, sources, request, options, tokenizer)
        except OSError as e:  # reading errors are ConfigErrors already: this is the store's own disk
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(
                f"could not write the token store under {root} ({os_reason(e)}; a full disk?); free some space "
                "or pass another --data.cache-dir"
            ) from None
        except hub.DownloadError:  # a hub file did not arrive: not the input, so the next call continues
            raise
        except Exception:  # bad input: something to change first, so nothing to continue
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(store, ignore_errors=True)
        os.replace(tmp, store)
    return TokenStore(store, meta)


def bpe_sample(cfg: DataConfig, train_files: list[Path], has_val: bool) -> Iterator[str]:
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
        raise ConfigError(
            "need at least 2 documents to hold some out for validation: pass --val-data, or, if the text "
            "has no <|endoftext|> lines, --data.separator blank-line (paragraphs as documents)"
        )
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
    tokenizer: Tokenizer | None = None,
) -> dict:
    """Tokenize the sources into a store in `directory`, continuing the build journaled there if it was
    interrupted (see `_Pass`); meta.json, written last, marks it complete."""
    started = time.time()
    _refuse_same_text(train_files, val_files, sources)
    saved = _interrupted(directory, sources)
    tok = _store_tokenizer(directory, cfg, train_files, val_files, tokenizer, saved is not None)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    total = sum(f["size"] for s in sources.values() for f in s)
    workers = auto_workers(cfg.tokenize_workers, total)
    writers = {s: SplitWriter(directory, s, dtype, saved and saved["splits"][s]) for s in ("train", "val")}
    journal = _Journal(directory, dtype)
    encoder = Encoder(tok, directory / "tokenizer", dtype, workers)
    tokenizing = _Pass(cfg, {"train": train_files, "val": val_files}, sources, writers, encoder, journal)
    try:
        with contextlib.closing(_Progress(total, tokenizing.start(saved))) as progress:
            notes = tokenizing.run(progress.update)
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
            "files": files_hashes(directory / "tokenizer"),
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
    journal.remove()
    return meta


def _store_tokenizer(
    directory: Path,
    cfg: DataConfig,
    train_files: list[Path],
    val_files: list[Path],
    given: Tokenizer | None,
    resumed: bool,
) -> Tokenizer:
    """`given`, or the one an interrupted build saved (a trained BPE is not trained again), or a new one;
    saved in directory/tokenizer."""
    if resumed:
        return given or load_tokenizer(directory / "tokenizer")
    tok = given or _make_tokenizer(cfg, train_files, val_files)
    tok.save(directory / "tokenizer")
    return tok


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
    Validation files are read first; off if there are none, or more than OVERLAP_MAX_DOCS documents.

    For the journal, new digests are appended to overlap.val / overlap.found in `directory` at each save,
    and an interrupted build's are read back by `restore`."""

    def __init__(self, active: bool, directory: Path) -> None:
        self.val: set[bytes] | None = set() if active else None
        self.found: set[bytes] = set()
        self.hash = None
        self.directory = directory
        self.new: dict[str, list[bytes]] = {"val": [], "found": []}  # added since the last save

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
            digest, self.hash = self.hash.digest(), None
            if split == "val" and digest not in self.val:
                self.val.add(digest)
                self.new["val"].append(digest)
                if len(self.val) > OVERLAP_MAX_DOCS:
                    self.val = None
            elif split == "train" and digest in self.val and digest not in self.found:
                self.found.add(digest)
                self.new["found"].append(digest)

    @property
    def hashing(self) -> bool:
        """Inside a document being hashed: a hash's state cannot be saved, so no place to journal."""
        return self.hash is not None

    def save(self) -> dict | None:
        """Append the digests added since the last save to their files; how many each should hold."""
        if self.val is None:
            return None
        for name, new in self.new.items():
            with open(self.directory / f"overlap.{name}", "ab") as f:
                f.write(b"".join(new))
            new.clear()
        return {"val": len(self.val), "found": len(self.found)}

    def restore(self, counts: dict | None) -> None:
        """The digests an interrupted build saved (`counts`: what `save` returned then)."""
        if counts is None:
            self.val = None
            return
        digests = {}
        for name in ("val", "found"):
            with open(self.directory / f"overlap.{name}", "r+b") as f:
                f.truncate(8 * counts[name])  # digests saved after the journal was written: added again
                data = f.read()
            digests[name] = {data[i : i + 8] for i in range(0, len(data), 8)}
        self.val, self.found = digests["val"], digests["found"]

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
    sample = bpe_sample(cfg, train_files, bool(val_files))
    first = next(sample, None)
    if first is None:  # no training text at all, or every document held out: say which
        n = sum(ends for f in train_files for _, _, ends in read_records(f, cfg, FileStats()))
        _check_counts(train_files, val_files, {"train": 0, "val": 0 if val_files else n})
    return BPETokenizer.train(itertools.chain([first], sample), cfg.bpe_vocab_size)


class _Pass:
    """The tokenizing pass: reads every source file once, routing its documents to a split's writer and
    tokenizing them as chunks fill up; records each file's sha256 and document count in `sources`.

    Validation files go to "val" whole; without them, `val_fraction` of the training documents do. At a
    reader's resume point, at most every JOURNAL_SECONDS, the chunks held are handed to the encoder, and once
    they are written the journal records all a later run needs to continue exactly there: the point, the
    writers' lengths, the router's and the overlap check's state, the warnings so far."""

    def __init__(
        self,
        cfg: DataConfig,
        files: dict[str, list[Path]],
        sources: dict[str, list[dict]],
        writers: dict[str, SplitWriter],
        encoder: Encoder,
        journal: _Journal,
    ) -> None:
        self.cfg, self.files, self.sources = cfg, files, sources
        self.writers, self.encoder, self.journal = writers, encoder, journal
        self.router = _Router(None if files["val"] else cfg.val_fraction)
        self.overlap = _Overlap(bool(files["val"]), journal.path.parent)
        self.notes: list[str] = []
        # Validation first: its documents are then looked up in the training text.
        self.order = [(s, i) for s in ("val", "train") for i in range(len(files[s]))]
        self.at: dict = {"split": self.order[0][0], "file": 0, "point": None, "target": self.order[0][0]}
        self.target = writers[self.at["target"]]  # the current document's writer
        self.point: dict | None = None  # a resume point to journal before the next record

    def start(self, saved: dict | None) -> int:
        """Continue where an interrupted pass journaled `saved`, or journal the start; bytes already read."""
        if saved is None:
            self.journal.write(self._state(), self.writers)
            return 0
        self.at, self.notes, self.router.first = saved["at"], saved["notes"], saved["first"]
        self.target = self.writers[self.at["target"]]
        self.overlap.restore(saved["overlap"])
        for split in ("train", "val"):
            for mine, journaled in zip(self.sources[split], saved["sources"][split], strict=True):
                mine.update(journaled)
        before = self.order[: self.order.index((self.at["split"], self.at["file"]))]
        done = sum(self.sources[s][i]["size"] for s, i in before) + (self.at["point"] or {}).get("bytes", 0)
        total = sum(f["size"] for s in self.sources.values() for f in s)
        print(
            f"continuing the interrupted build in {self.journal.path.parent}: {_size(done)} of {_size(total)} done"
        )
        return done

    def run(self, advance: Callable[[int], None]) -> list[str]:
        """Read from where `start` left off to the end; the warnings to give."""
        start = self.at["point"]
        for split, i in self.order[self.order.index((self.at["split"], self.at["file"])) :]:
            self._read(split, i, start, advance)
            start = None
        for w in self.writers.values():
            self.encoder.submit(w)
        self.encoder.drain()
        return self.notes + self.overlap.note(self.files["val"])

    def _read(self, split: str, i: int, start: dict | None, advance: Callable[[int], None]) -> None:
        path, source, stats = self.files[split][i], self.sources[split][i], FileStats()
        if start is None:
            source["sha256"] = sha256_of(path)
            self.target = self.writers[split]
        self.at = {"split": split, "file": i, "point": None}
        for text, begins, ends in read_records(path, self.cfg, stats, advance, start, self._mark):
            if self.point is not None:  # here, not in _mark: an error writing is not one reading
                self._checkpoint()
            if begins and split == "train":
                self.target = self.writers[self.router(text)]
            self.overlap.add(split, text, begins, ends)
            if self.target.add(text, begins, ends):
                self.encoder.submit(self.target)
        self.point = None
        source["documents"] = stats.documents
        self.notes += file_warnings(path, stats)

    def _mark(self, point: dict) -> None:
        if not self.overlap.hashing and self.journal.due():
            self.point = point

    def _checkpoint(self) -> None:
        """Journal the resume point once the chunks with the records before it are written."""
        self.at["point"], self.point = self.point, None
        for w in self.writers.values():
            self.encoder.submit(w)
        self.encoder.after(functools.partial(self.journal.write, self._state(), self.writers))

    def _state(self) -> dict:
        """Where the pass stands, as plain JSON (the writers' lengths are added when it is written)."""
        return {
            "at": {**self.at, "target": self.target.split},
            "first": self.router.first,
            "overlap": self.overlap.save(),
            "notes": list(self.notes),
            "sources": copy.deepcopy(self.sources),
        }


class _Journal:
    """journal.json in a store being built: how far tokenizing got (see `_Pass`), replaced atomically, so a
    build killed at any moment (kill -9, a lost machine) continues from its last journal, not from zero."""

    def __init__(self, directory: Path, dtype: np.dtype) -> None:
        self.path = directory / "journal.json"
        # What must not have changed to continue: the store's version and tokenizer (checked by
        # _not_resumable), and the token type the lengths count in.
        tokenizer = files_hashes(directory / "tokenizer")
        self.fixed = {"version": STORE_VERSION, "tokenizer": tokenizer, "dtype": dtype.name}
        self.last = time.monotonic()

    def due(self) -> bool:
        """True at most once every JOURNAL_SECONDS."""
        if time.monotonic() - self.last < JOURNAL_SECONDS:
            return False
        self.last = time.monotonic()
        return True

    def write(self, state: dict, writers: dict[str, SplitWriter]) -> None:
        for w in writers.values():
            w.flush()
        splits = {s: w.counts() for s, w in writers.items()}
        files.write_json(self.path, {**self.fixed, **state, "splits": splits})

    def remove(self) -> None:
        """Once the store is complete: the journal and the files only it needed."""
        for name in ("journal.json", "train.docs.tmp", "val.docs.tmp", "overlap.val", "overlap.found"):
            (self.path.parent / name).unlink(missing_ok=True)


def _interrupted(directory: Path, sources: dict[str, list[dict]]) -> dict | None:
    """The journal of an interrupted build in `directory` if it can be continued; otherwise None, and
    `directory` emptied for a build from scratch."""
    saved, why = None, None
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads((directory / "journal.json").read_text())
    if saved is not None:
        try:
            why = _not_resumable(directory, saved, sources)
        except (KeyError, TypeError, AttributeError):  # not a journal this version writes
            why = "its journal is not one this version of minigpt reads"
        if why is None:
            return saved
        print(f"not continuing the interrupted build in {directory}: {why}; starting over")
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return None


def _not_resumable(directory: Path, saved: dict, sources: dict[str, list[dict]]) -> str | None:
    """Why the journaled build cannot be continued, or None if it can."""
    if saved.get("version") != STORE_VERSION:
        return "it was made by another version of minigpt"
    if not same_files(saved["sources"], sources, ("path", "size", "mtime_ns")):
        return "the source files changed since"
    try:
        tokenizer_files = files_hashes(directory / "tokenizer")
    except OSError:
        tokenizer_files = {}
    if tokenizer_files != saved["tokenizer"]:
        return "its tokenizer files are missing or changed"
    needed = {f"overlap.{k}": 8 * n for k, n in (saved["overlap"] or {}).items()}
    for split, done in saved["splits"].items():
        needed[f"{split}.bin"] = done["tokens"] * np.dtype(saved["dtype"]).itemsize
        needed[f"{split}.docs.tmp"] = done["documents"] * 8
    for name, size in needed.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size < size:
            return f"{name} is shorter than its journal says (lost in a crash?)"
    return None


class _Progress:
    """Bytes tokenized, with the rate and an ETA: a tqdm bar on a terminal; elsewhere (a log file, CI), where
    a bar's carriage returns pile up, a line every PROGRESS_SECONDS."""

    def __init__(self, total: int, done: int) -> None:
        self.total, self.done, self.first = total, done, done
        self.started = self.shown = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(
                total=total, initial=done, desc="tokenize", unit="B", unit_scale=True, leave=False
            )

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.shown >= PROGRESS_SECONDS:
            self.shown = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        rate = (self.done - self.first) / max(time.monotonic() - self.started, 1e-9)  # since this run began
        eta = tqdm.format_interval((self.total - self.done) / rate) if rate > 0 else "?"
        return (
            f"tokenize: {_size(self.done)} of {_size(self.total)} ({self.done / max(self.total, 1):.0%}) | "
            f"{rate / 1e6:.1f} MB/s | ETA {eta}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _size(n_bytes: int) -> str:
    return tqdm.format_sizeof(n_bytes, "B")  # 12.3kB, 2.10GB
