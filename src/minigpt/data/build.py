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
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from minigpt.config import ConfigError, DataConfig
from minigpt.data import hub
from minigpt.data.chat import ExampleRecord
from minigpt.data.corpus import (
    FileStats,
    download_tinystories,
    file_warnings,
    mixed_kinds,
    os_reason,
    read_records,
    resolve_files,
    sources_hold_examples,
)
from minigpt.data.encode import Encoder, SplitWriter, auto_workers
from minigpt.data.holdout import Overlap, Router, one_text_by_paragraphs
from minigpt.data.journal import Journal, PrefixHash, interrupted, read_extent
from minigpt.data.progress import Progress, files_named, megabytes, say_prefix
from minigpt.data.ranged import RangedFile
from minigpt.data.saved_tokenizer import load_tokenizer, open_pretrained
from minigpt.data.store import (
    CHUNK_BYTES,
    STORE_VERSION,
    TokenStore,
    chunk_digests,
    files_hashes,
    reusable,
    sha256_of,
    store_identity,
)
from minigpt.data.tokenizer import BPETokenizer, GPT2Tokenizer, Tokenizer, find_gpt2_files
from minigpt.runtime import files
from minigpt.runtime.errors import DataWarning

JOURNAL_SECONDS = 5.0
"""How often (at most) an interrupted build's journal is brought up to date: about the work a kill loses."""
PREFIX_MIN_TOKENS = 8 << 20
"""A build for a run tokenizes at least this many training tokens (or the whole corpus): below it a paused
build saves a few seconds at most, and small corpora stay whole."""
PREFIX_MARGIN = 0.05
"""A build for a run tokenizes this fraction more than the run reads: per-process striding and batches cut
at an epoch's end read a little more than steps x tokens per step."""


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


@dataclasses.dataclass(frozen=True)
class _Request:
    """What a store is built from: the sources found, their records, the tokenizer and reading options."""

    cfg: DataConfig
    train_files: list[Path]
    val_files: list[Path]
    sources: dict[str, list[dict]]
    request: str
    options: dict
    tokenizer: Tokenizer | None


TrainTokens = int | Callable[[], int | None] | None
"""The training tokens a run reads: a count, a function that works it out (called only if a store must be
built or extended), or None for the whole corpus."""


def prepare(
    cfg: DataConfig, tokenizer: Tokenizer | None = None, train_tokens: TrainTokens = None
) -> TokenStore:
    """Tokenize the corpus once into a cached token store; reuse it while sources and tokenizer are unchanged.

    The store's folder is named by what was asked for (source paths as given, tokenizer, reading options);
    its meta.json records what was found (each file's size, mtime and sha256). A later call with the same
    request reuses the store if every file still has its size and mtime (or, if only mtimes moved, its
    sha256), and otherwise rebuilds it. `tokenizer`, if given, is used instead of the one the config asks
    for (the sources of a mixture share one). `train_tokens`: what a run reads; the build then pauses once
    the training split holds a little more (at least PREFIX_MIN_TOKENS), and a later call that needs more
    extends the same store in place. None: the whole corpus."""
    train_paths, val_paths = cfg.paths, cfg.val_paths
    if not train_paths:
        train_paths, hub_val = download_tinystories()
        val_paths = val_paths or hub_val
    train_files, val_files = resolve_files(train_paths), resolve_files(val_paths, "--val-data")
    both = set(train_files) & set(val_files)
    if both:
        raise ConfigError(f"{sorted(both)[0]} is both training and validation data")
    cfg = one_text_by_paragraphs(cfg, train_files, val_files)
    if tokenizer is None and cfg.tokenizer == "hf":
        tokenizer = open_pretrained(cfg.hf_tokenizer or "")
        request = tokenizer.identity  # named by its content, wherever the folder is
    else:
        request = _tokenizer_request(cfg) if tokenizer is None else f"shared-{tokenizer.identity}"
    examples = sources_hold_examples(cfg, train_files, val_files, tokenizer)
    options = {
        "separator": cfg.separator,
        "text_field": cfg.text_field,
        "encoding_errors": cfg.encoding_errors,
        "val_fraction": None if val_files else cfg.val_fraction,
        "bpe_train_bytes": cfg.bpe_train_bytes if cfg.tokenizer == "bpe" else None,
    } | (_rendering(tokenizer) if examples else {})
    key_src = {
        "version": STORE_VERSION,
        "train": [p if hub.is_spec(p) else str(Path(p).expanduser().absolute()) for p in train_paths],
        "val": [p if hub.is_spec(p) else str(Path(p).expanduser().absolute()) for p in val_paths],
        "tokenizer": request,
        "options": options,
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    root = cfg.cache() / "tokens"
    sources = {"train": [_stat(f) for f in train_files], "val": [_stat(f) for f in val_files]}
    req = _Request(cfg, train_files, val_files, sources, request, options, tokenizer)
    goal = functools.cache(lambda: _goal(train_tokens() if callable(train_tokens) else train_tokens))
    enough = lambda meta: (
        meta is not None and (meta["complete"] or ((g := goal()) and meta["splits"]["train"]["tokens"] >= g))
    )
    # A store that will do needs no lock, so users who may only read it can read it.
    meta = reusable(root / key, request, sources)
    if not enough(meta):
        with files.locked(root / f"{key}.lock"):
            meta = reusable(root / key, request, sources)
            if not enough(meta):
                meta = _make(root, key, req, goal(), meta)
    return TokenStore(root / key, meta, own_tokenizer=tokenizer if cfg.tokenizer == "hf" else None)


def _rendering(tokenizer: Tokenizer) -> dict:
    """What decides a store of examples' tokens besides the tokenizer: its chat template and how it renders
    (`ChatTemplate.identity`), so a checkpoint with another template gets a store of its own."""
    return {"examples": True, "rendering": tokenizer.chat_template().identity()}  # type: ignore[attr-defined]


def _dtype(tok: Tokenizer, examples: bool) -> np.dtype:
    """The store's token type: 16 bits where they hold the vocabulary; examples' flags need 32."""
    return np.dtype(np.uint16 if tok.vocab_size <= 2**16 and not examples else np.uint32)


def _goal(train_tokens: int | None) -> int | None:
    """How far to build for a run of `train_tokens`: a little more, and at least PREFIX_MIN_TOKENS."""
    if train_tokens is None:
        return None
    return max(math.ceil(train_tokens * (1 + PREFIX_MARGIN)), PREFIX_MIN_TOKENS)


def _make(root: Path, key: str, req: _Request, goal: int | None, paused: dict | None) -> dict:
    """Continue a paused build in place (appending only: readers of its first tokens read on), or build the
    store from scratch in a temporary folder that then replaces it."""
    store, tmp = root / key, root / f"{key}.tmp"  # tmp is kept if interrupted: the next call continues it
    if paused is not None:
        with _on_error(store, root, remove=False):
            meta = _build(store, req, goal, paused)
        if meta is not None:
            return meta
    tmp.mkdir(parents=True, exist_ok=True)
    with _on_error(tmp, root, remove=True):
        meta = _build(tmp, req, goal)
    shutil.rmtree(store, ignore_errors=True)  # readers of the old store keep its files open
    os.replace(tmp, store)
    return meta


@contextlib.contextmanager
def _on_error(directory: Path, root: Path, remove: bool) -> Iterator[None]:
    """A failed build's folder: removed (if `remove`) unless the build can continue (a hub file that did not
    arrive); a full disk said in one line."""
    try:
        yield
    except OSError as e:  # reading errors are ConfigErrors already: this is the store's own disk
        if remove:
            shutil.rmtree(directory, ignore_errors=True)
        raise ConfigError(
            f"could not write the token store under {root} ({os_reason(e)}; a full disk?); free some space "
            "or pass another --data.cache-dir"
        ) from None
    except hub.DownloadError:  # a hub file did not arrive: not the input, so the next call continues
        raise
    except Exception:  # bad input: something to change first, so nothing to continue
        if remove:
            shutil.rmtree(directory, ignore_errors=True)
        raise


def bpe_sample(
    cfg: DataConfig, train_files: list[Path], has_val: bool, read: list[int] | None = None
) -> Iterator[str]:
    """The first bpe_train_bytes (UTF-8) of training documents (as routed by the full pass), in order;
    `read[0]` counts the source files' bytes read for them."""
    route, budget, read = Router(None if has_val else cfg.val_fraction), cfg.bpe_train_bytes, read or [0]
    split = "train"
    for path in train_files:
        with contextlib.closing(read_records(path, cfg, FileStats(), _counter(read))) as records:
            for text, begins, _ in records:
                if begins:
                    split = route(text)
                if split == "train":
                    yield text
                    budget -= len(text) if text.isascii() else len(text.encode())
                    if budget <= 0:
                        return


def _counter(read: list[int]) -> Callable[[int], None]:
    def advance(n: int) -> None:
        read[0] += n

    return advance


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


NO_TARGETS_WARN = 0.1
"""Warn when more than this share of a split's examples has no target (no assistant message)."""


def _check_targets(
    train_files: list[Path], val_files: list[Path], writers: dict[str, SplitWriter]
) -> list[str]:
    """Refuse a split of examples with nothing to learn or score (no assistant message, no completion): its
    loss would be 0 over no tokens. The warnings for splits where many examples have none."""
    notes = []
    for split, w in writers.items():
        named = ", ".join(map(str, val_files if split == "val" and val_files else train_files))
        what = (
            f"the {w.documents:,} examples"
            if split == "train" or val_files
            else f"the {w.documents:,} held out"
        )
        if w.documents and not w.targets:
            raise ConfigError(
                f"{named}: {what} for {'training' if split == 'train' else 'validation'} have no assistant "
                "message (or completion), and the loss is taken on the assistant's tokens only, so there is "
                "nothing to learn or measure; add the assistant's replies"
            )
        if w.without_targets > NO_TARGETS_WARN * w.documents:
            notes.append(
                f"{named}: {w.without_targets:,} of {what} for {'training' if split == 'train' else 'validation'} "
                f"({w.without_targets / w.documents:.0%}) have no assistant message (or completion): they add "
                "nothing to the loss"
            )
    return notes


def _build(directory: Path, req: _Request, goal: int | None, paused: dict | None = None) -> dict | None:
    """Tokenize the sources into a store in `directory`, continuing the build journaled there if it was
    interrupted or paused (see `_Pass`), to the end or until the training split holds `goal` tokens;
    meta.json, written last, says which. With `paused` (the store's meta), None if its journal cannot be
    continued, and the store is left as it is."""
    started = time.time()
    _refuse_same_text(req.train_files, req.val_files, req.sources)
    paths = {"train": req.train_files, "val": req.val_files}
    saved = interrupted(directory, req.sources, paths, clear=paused is None)
    if paused is not None and saved is None:
        return None
    tok = _store_tokenizer(directory, req, saved is not None, goal)
    dtype = _dtype(tok, "examples" in req.options)
    total = sum(f["size"] for s in req.sources.values() for f in s)
    val = sum(f["size"] for f in req.sources["val"])
    # A build to a goal reads about this much: worker processes pay off only for a large part of a corpus.
    workers = auto_workers(req.cfg.tokenize_workers, total if goal is None else min(total, val + 4 * goal))
    examples = "examples" in req.options
    writers = {
        s: SplitWriter(directory, s, dtype, saved and saved["splits"][s], examples) for s in ("train", "val")
    }
    journal = Journal(directory, dtype, JOURNAL_SECONDS)
    encoder = Encoder(tok, directory / "tokenizer", dtype, workers)
    files_ = {"train": req.train_files, "val": req.val_files}
    tokenizing = _Pass(req.cfg, files_, req.sources, writers, encoder, journal, goal, examples)
    try:
        done = tokenizing.start(saved, paused)
        named = {s: files_named(paths[s], [f["size"] for f in req.sources[s]]) for s in paths}
        whole = goal is not None and goal >= sum(f["size"] for f in req.sources["train"])
        say_prefix(goal, named["train"], named["val"], whole, paused)
        with contextlib.closing(Progress(total, done, goal, writers["train"])) as progress:
            complete = tokenizing.run(progress.update)
    finally:
        encoder.close()
    notes = tokenizing.notes + tokenizing.overlap.note(req.val_files)
    if examples:
        notes += _check_targets(req.train_files, req.val_files, writers)
    for note in notes:  # after the progress bar is gone; pointing at prepare's caller
        warnings.warn(note, DataWarning, stacklevel=4)
    splits = {s: w.finish() for s, w in writers.items()}
    for s in splits:  # what `minigpt check` compares the token files with, and readers each chunk
        splits[s]["sha256"] = sha256_of(directory / f"{s}.bin", directory / f"{s}.docs.npy")
        nbytes = splits[s]["tokens"] * np.dtype(dtype).itemsize
        splits[s]["chunks"] = {
            "bytes": CHUNK_BYTES,
            "blake2b": chunk_digests(directory / f"{s}.bin", nbytes, CHUNK_BYTES),
        }
    _check_counts(req.train_files, req.val_files, {s: splits[s]["documents"] for s in splits})
    meta = _meta(directory, req, tok, complete, splits, notes)
    meta["identity"] = paused["identity"] if paused else store_identity(meta)
    meta["build"] = {"seconds": round(time.time() - started, 2), "workers": workers}
    files.write_json(directory / "meta.json", meta)
    if complete:
        journal.remove()
    return meta


def _meta(
    directory: Path, req: _Request, tok: Tokenizer, complete: bool, splits: dict, notes: list[str]
) -> dict:
    return {
        "version": STORE_VERSION,
        "complete": complete,
        "sources": req.sources,
        "options": req.options,
        "tokenizer": {
            "request": req.request,
            "identity": tok.identity,
            "vocab_hash": tok.vocab_hash,
            "files": files_hashes(directory / "tokenizer"),
        },
        "tokenizer_identity": tok.identity,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": _dtype(tok, "examples" in req.options).name,
        "examples": "examples" in req.options,
        "splits": splits,
        "warnings": notes,
    }


def _store_tokenizer(directory: Path, req: _Request, resumed: bool, goal: int | None) -> Tokenizer:
    """The given one (a mixture's), or the one an interrupted build saved (a trained BPE is not trained
    again), or a new one; saved in directory/tokenizer."""
    if resumed:
        return req.tokenizer or load_tokenizer(directory / "tokenizer")
    tok = req.tokenizer or _make_tokenizer(req, goal)
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


BPE_BYTES_PER_TOKEN = 3
"""A floor under the text bytes a trained byte-level BPE's token stands for on text like the text it learned
from (prose, code): a run of N tokens reads at least this many times N bytes, so a BPE learned from at most
that much text learns from no more than the run reads."""


def _make_tokenizer(req: _Request, goal: int | None) -> Tokenizer:
    """GPT-2's BPE, or a byte-level BPE trained on the first bpe_train_bytes of training text, and for a run
    that reads less (a build to a `goal` of tokens), on no more than it reads."""
    cfg, train_files, val_files = req.cfg, req.train_files, req.val_files
    if cfg.tokenizer == "gpt2":
        return GPT2Tokenizer(find_gpt2_files(cfg.gpt2_dir))
    budget = cfg.bpe_train_bytes if goal is None else min(cfg.bpe_train_bytes, goal * BPE_BYTES_PER_TOKEN)
    sizes = [f["size"] for f in req.sources["train"]]
    text = files_named(train_files, sizes)
    print(
        f"training a {cfg.bpe_vocab_size}-token byte-level BPE on "
        + (
            f"the training documents of {text}"
            if sum(sizes) <= budget
            else f"the first {megabytes(budget)} of {text}"
        )
    )
    read = [0]
    sample = bpe_sample(dataclasses.replace(cfg, bpe_train_bytes=budget), train_files, bool(val_files), read)
    first = next(sample, None)
    if first is None:  # no training text at all, or every document held out: say which
        n = sum(ends for f in train_files for _, _, ends in read_records(f, cfg, FileStats()))
        _check_counts(train_files, val_files, {"train": 0, "val": 0 if val_files else n})
    return BPETokenizer.train(
        itertools.chain([first], sample), cfg.bpe_vocab_size, read_bytes=lambda: read[0]
    )


class _Pass:
    """The tokenizing pass: reads every source file once, routing its documents to a split's writer and
    tokenizing them as chunks fill up; records each file's sha256 and document count in `sources`.

    Validation files go to "val" whole; without them, `val_fraction` of the training documents do. At a
    reader's resume point, at most every JOURNAL_SECONDS, the chunks held are handed to the encoder, and once
    they are written the journal records all a later run needs to continue exactly there: the point, the
    writers' lengths, the router's and the overlap check's state, the warnings so far, and a digest of the
    bytes read of the file being read. With a `goal`, the pass pauses (journaled) at the first resume point
    where the training split holds `goal` tokens."""

    def __init__(
        self,
        cfg: DataConfig,
        files: dict[str, list[Path]],
        sources: dict[str, list[dict]],
        writers: dict[str, SplitWriter],
        encoder: Encoder,
        journal: Journal,
        goal: int | None = None,
        examples: bool = False,
    ) -> None:
        self.cfg, self.files, self.sources, self.goal, self.examples = cfg, files, sources, goal, examples
        self.writers, self.encoder, self.journal = writers, encoder, journal
        self.router = Router(None if files["val"] else cfg.val_fraction)
        self.overlap = Overlap(bool(files["val"]), journal.path.parent)
        self.notes: list[str] = []
        # Validation first: its documents are then looked up in the training text.
        self.order = [(s, i) for s in ("val", "train") for i in range(len(files[s]))]
        self.at: dict = {"split": self.order[0][0], "file": 0, "point": None, "target": self.order[0][0]}
        self.target = writers[self.at["target"]]  # the current document's writer
        self.point: dict | None = None  # a resume point to journal before the next record
        self.read_so_far = PrefixHash(files[self.order[0][0]][0])  # of the file being read

    def start(self, saved: dict | None, paused: dict | None = None) -> int:
        """Continue where an interrupted (or `paused`) pass journaled `saved`, or journal the start; bytes
        already read."""
        if saved is None:
            self.journal.write(self._state(), self.writers)
            return 0
        self.at, self.notes, self.router.first = saved["at"], saved["notes"], saved["first"]
        self.target = self.writers[self.at["target"]]
        self.read_so_far = PrefixHash(self.files[self.at["split"]][self.at["file"]])
        self.overlap.restore(saved["overlap"])
        for split in ("train", "val"):
            for mine, journaled in zip(self.sources[split], saved["sources"][split], strict=True):
                mine.update(journaled)
        before = self.order[: self.order.index((self.at["split"], self.at["file"]))]
        done = sum(self.sources[s][i]["size"] for s, i in before) + (self.at["point"] or {}).get("bytes", 0)
        total = sum(f["size"] for s in self.sources.values() for f in s)
        if paused is None:
            print(
                f"continuing the interrupted build in {self.journal.path.parent}: {megabytes(done)} of "
                f"{megabytes(total)} done"
            )
        return done

    def run(self, advance: Callable[[int], None]) -> bool:
        """Read from where `start` left off to the end (True), or to the pause at the goal (False)."""
        start = self.at["point"]
        for split, i in self.order[self.order.index((self.at["split"], self.at["file"])) :]:
            if self._read(split, i, start, advance):
                return False
            start = None
        for w in self.writers.values():
            self.encoder.submit(w)
        self.encoder.drain()
        return True

    def _read(self, split: str, i: int, start: dict | None, advance: Callable[[int], None]) -> bool:
        """Read one file from `start`; True if the pass paused in it."""
        path, source, stats = self.files[split][i], self.sources[split][i], FileStats()
        if start is None:
            # A hub file fetched by range: the hub's sha256, so none of it is fetched for it.
            source["sha256"] = path.sha256 if isinstance(path, RangedFile) else sha256_of(path)
            self.target = self.writers[split]
            self.read_so_far = PrefixHash(path)
        self.at = {"split": split, "file": i, "point": None}
        with contextlib.closing(read_records(path, self.cfg, stats, advance, start, self._mark)) as records:
            for text, begins, ends in records:
                if self.point is not None:  # here, not in _mark: an error writing is not one reading
                    if self._pause():
                        return True
                    self._checkpoint()
                if isinstance(text, ExampleRecord) != self.examples:  # a hub file's, judged by the first's
                    raise mixed_kinds(path, text, self.examples)
                if begins and split == "train":
                    self.target = self.writers[self.router(text)]
                self.overlap.add(split, text, begins, ends)
                if self.target.add(text, begins, ends):
                    self.encoder.submit(self.target)
        self.point = None
        source["documents"] = stats.documents
        self.notes += file_warnings(path, stats)
        return False

    def _mark(self, point: dict) -> None:
        if not self.overlap.hashing and (self._near_goal() or self.journal.due()):
            self.point = point

    def _near_goal(self) -> bool:
        """Whether the training split may hold the goal's tokens once what is queued is written: a token is
        at least a byte of text, so the bytes queued bound the tokens they make."""
        train = self.writers["train"]
        return self.goal is not None and train.tokens + train.pending_bytes() >= self.goal

    def _pause(self) -> bool:
        """At a resume point near the goal: write what is queued; if the goal is reached, journal the point
        (the paused build's end) and stop. The first point at or past the goal, however fast workers are."""
        if not self._near_goal():
            return False
        for w in self.writers.values():
            self.encoder.submit(w)
        self.encoder.drain()
        if self.writers["train"].tokens < self.goal:
            return False
        self.at["point"], self.point = self.point, None
        self.journal.write(self._state(), self.writers)
        return True

    def _checkpoint(self) -> None:
        """Journal the resume point once the chunks with the records before it are written."""
        self.at["point"], self.point = self.point, None
        for w in self.writers.values():
            self.encoder.submit(w)
        self.encoder.after(functools.partial(self.journal.write, self._state(), self.writers))

    def _state(self) -> dict:
        """Where the pass stands, as plain JSON (the writers' lengths are added when it is written)."""
        path = self.files[self.at["split"]][self.at["file"]]
        read = read_extent(path, self.at["point"])
        return {
            "at": {**self.at, "target": self.target.split},
            "first": self.router.first,
            "overlap": self.overlap.save(),
            "notes": list(self.notes),
            "sources": copy.deepcopy(self.sources),
            "prefix": {"bytes": read, "sha256": self.read_so_far.upto(read)},
        }
