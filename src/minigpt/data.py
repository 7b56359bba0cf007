"""Text corpus -> token store (tokenized once, streamed to disk) -> Grain pipeline of packed windows.

Sources are `.txt` files (documents separated by `<|endoftext|>` or by blank lines), `.jsonl` files (one
JSON object per line, the text under `text_field`) and `.parquet` files (the `text_field` column), given as
files, folders or glob patterns. They are read as a stream, in blocks, and tokenized chunk by chunk (in
worker processes on machines with cores to spare), so no step holds the whole corpus, its text or its
tokens in memory. The trained BPE sees only the first `bpe_train_bytes` of training text.

Documents are concatenated with an end-of-text token after each one and cut into windows of seq_len + 1
tokens with stride seq_len. Nothing is padded, so no compute and no loss is spent on pad positions, and every
token is a training target exactly once per epoch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import glob
import hashlib
import itertools
import json
import mmap
import multiprocessing
import os
import re
import shutil
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import grain
import numpy as np
from tqdm import tqdm

from minigpt.config import ConfigError, DataConfig
from minigpt.tokenizer import EOT, BPETokenizer, GPT2Tokenizer, Tokenizer, find_gpt2_files, load_tokenizer

TINYSTORIES = ("roneneldan/TinyStories", "TinyStories-train.txt", "TinyStories-valid.txt")
STORE_VERSION = 2
SOURCE_SUFFIXES = (".txt", ".jsonl", ".parquet")
"""What a folder is searched for; a file named explicitly (or matched by a glob) of any other suffix is text."""

BLOCK_BYTES = 1 << 20
"""Text files are read in blocks of this size."""
PIECE_CHARS = 1 << 20
"""Longer documents go to the tokenizer in pieces of at most this size, cut where GPT-2's pre-tokenizer
splits anyway (after a line break, before a non-space), so the tokens equal those of the whole document."""
LONG_DOC_BYTES = 64 << 20
"""A document longer than this is tokenized (in pieces) but warned about: the separator is probably wrong."""
CHUNK_CHARS = 1 << 20
"""Text per unit of tokenizer work (one worker task)."""
AUTO_WORKERS_MIN_BYTES = 64 << 20
"""Below this much source text, worker processes cost more to start than they save."""


class DataWarning(UserWarning):
    """Input that was used anyway, but probably not as intended (replaced bytes, huge documents)."""


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

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


# ----------------------------------------------------------------------------------------------- sources


def resolve_files(paths: Iterable[str]) -> list[Path]:
    """Expand files, folders (recursively: .txt, .jsonl, .parquet) and glob patterns into a file list.

    Folders and globs expand in sorted order; a file given twice is read once; missing paths are errors."""
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if glob.has_magic(str(path)):
            matches = [Path(m) for m in sorted(glob.glob(str(path), recursive=True))]
            if not matches:
                raise ConfigError(f"no files match {p}")
            for m in matches:
                files.extend(_folder_files(m) if m.is_dir() else [m])
        elif path.is_dir():
            files.extend(_folder_files(path))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"data path not found: {path}")
    unique = {f.resolve(): None for f in files}
    return list(unique)


def _folder_files(folder: Path) -> list[Path]:
    found = sorted(
        f
        for f in folder.rglob("*")
        if f.suffix in SOURCE_SUFFIXES
        and f.is_file()
        and not any(part.startswith(".") for part in f.relative_to(folder).parts)
    )
    if not found:
        raise ConfigError(f"folder {folder} holds no {', '.join(SOURCE_SUFFIXES)} files")
    return found


@dataclasses.dataclass
class _FileStats:
    replaced: int = 0
    long_docs: int = 0
    documents: int = 0


def _decode(raw: bytes, path: Path, offset: int, errors: str, stats: _FileStats, where: str = "") -> str:
    """UTF-8 text of raw, which starts at byte `offset` of the file; a byte-order mark at 0 is dropped."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "error":
            raise ConfigError(
                f"{path}{where} is not valid UTF-8 (bad byte at offset {offset + e.start}); "
                "pass --data.encoding-errors replace to replace undecodable bytes"
            ) from None
        text = raw.decode("utf-8", "replace")
        stats.replaced += text.count("\ufffd") - raw.count("\ufffd".encode())  # minus genuine U+FFFDs
    return text[1:] if offset == 0 and not where and text.startswith("\ufeff") else text


def _check_text(raw: bytes, path: Path, offset: int) -> None:
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise ConfigError(f"{path} is not a text file (NUL byte at offset {offset + nul})")


def _cut(buf, lo: int, hi: int) -> int:
    """Where to end a piece of buf (str or bytes), in [lo, hi]: after a line break, else before a space, that
    has a non-space on either side. GPT-2's pre-tokenizer (tiktoken's and HF's byte-level alike) always
    splits there, so the pieces tokenize exactly like the whole. Failing both (no such break in the window),
    at hi, moved back to a UTF-8 character boundary for bytes."""
    for sep, after in (("\n", 1), (" ", 0)):
        if isinstance(buf, bytes):
            sep = sep.encode()
        j = buf.rfind(sep, lo, hi)
        while j > lo and (buf[j - 1 : j].isspace() or buf[j + 1 : j + 2].isspace() or j + 1 >= len(buf)):
            j = buf.rfind(sep, lo, j)
        if j > lo:
            return j + after
    if isinstance(buf, bytes):
        while hi > lo + 1 and (buf[hi] & 0xC0) == 0x80:
            hi -= 1
    return hi


Record = tuple[str, bool, bool]
"""(text, begins a document, ends a document): a whole document, or a piece of a long one."""


def _read_txt(
    path: Path, cfg: DataConfig, stats: _FileStats, advance: Callable[[int], None]
) -> Iterator[Record]:
    eot = EOT.encode()
    sep_b = re.compile(rb"\n[ \t\r\f\v]*\n")
    sep_s = re.compile(re.escape(EOT) if cfg.separator == "eot" else r"\n[ \t\r\f\v]*\n")
    carry, offset = b"", 0  # offset: position of carry[0] in the file
    in_doc = False  # carry continues a document whose first pieces were already yielded
    with open(path, "rb") as f:
        while True:
            block = f.read(BLOCK_BYTES)
            advance(len(block))
            _check_text(block, path, offset + len(carry))
            buf = carry + block
            if not block:
                cut = len(buf)
            elif cfg.separator == "eot":
                i = buf.rfind(eot)
                cut = i + len(eot) if i >= 0 else 0
            else:
                cut = max((m.end() for m in sep_b.finditer(buf)), default=0)
            if not cut and not block and in_doc:
                yield "", False, True
            if cut:
                docs = sep_s.split(_decode(buf[:cut], path, offset, cfg.encoding_errors, stats))
                if in_doc:
                    yield docs[0].rstrip(), False, True
                    docs, in_doc = docs[1:], False
                for doc in docs:
                    doc = doc.strip()
                    if doc:
                        yield doc, True, True
            carry, offset = buf[cut:], offset + cut
            if not block:
                return
            while len(carry) > 2 * PIECE_CHARS:  # no separator in sight: pass on a piece of this document
                c = _cut(carry, PIECE_CHARS // 2, PIECE_CHARS)
                piece = _decode(carry[:c], path, offset, cfg.encoding_errors, stats)
                if not in_doc:
                    piece = piece.lstrip()
                if piece or in_doc:
                    yield piece, not in_doc, False
                    in_doc = True
                carry, offset = carry[c:], offset + c


def _read_jsonl(
    path: Path, cfg: DataConfig, stats: _FileStats, advance: Callable[[int], None]
) -> Iterator[Record]:
    field, offset = cfg.text_field, 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            advance(len(line))
            _check_text(line, path, offset)
            text_line = _decode(line, path, offset, cfg.encoding_errors, stats)
            offset += len(line)
            if not text_line.strip():
                continue
            try:
                obj = json.loads(text_line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno} is not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{path}:{lineno} must be a JSON object, got {type(obj).__name__}")
            if field not in obj:
                keys = ", ".join(list(obj)[:8])
                raise ConfigError(
                    f'{path}:{lineno} has no "{field}" field (it has: {keys}); choose one with --data.text-field'
                )
            text = obj[field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ConfigError(f'{path}:{lineno}: "{field}" must be a string, got {type(text).__name__}')
            try:
                text.encode()
            except UnicodeEncodeError:  # a lone surrogate written as a \ud8xx escape
                if cfg.encoding_errors == "error":
                    raise ConfigError(
                        f"{path}:{lineno} holds a lone UTF-16 surrogate escape, which is not text; "
                        "pass --data.encoding-errors replace to replace it"
                    ) from None
                fixed = text.encode("utf-8", "replace").decode()
                stats.replaced += fixed.count("?") - text.count("?")
                text = fixed
            if text.strip():
                yield text, True, True


def _read_parquet(
    path: Path, cfg: DataConfig, stats: _FileStats, advance: Callable[[int], None]
) -> Iterator[Record]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise ConfigError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from None
    schema, field = pf.schema_arrow, cfg.text_field
    if field not in schema.names:
        raise ConfigError(
            f'{path} has no "{field}" column (it has: {", ".join(schema.names[:8])}); '
            "choose one with --data.text-field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f'{path}: column "{field}" holds {kind}, not strings')
    size, rows_total, rows_done, reported = path.stat().st_size, max(pf.metadata.num_rows, 1), 0, 0
    for batch in pf.iter_batches(batch_size=4096, columns=[field]):
        for row, raw in enumerate(batch.column(0).cast(pa.large_binary()).to_pylist(), rows_done):
            if raw is None:
                continue
            text = _decode(raw, path, 0, cfg.encoding_errors, stats, where=f" row {row}")
            if text.strip():
                yield text, True, True
        rows_done += batch.num_rows
        done = size * rows_done // rows_total
        advance(done - reported)
        reported = done
    advance(size - reported)


def _records(
    path: Path, cfg: DataConfig, stats: _FileStats, advance: Callable[[int], None] = lambda n: None
) -> Iterator[Record]:
    """One source file's documents, long ones in pieces of at most PIECE_CHARS characters."""
    reader = {".jsonl": _read_jsonl, ".parquet": _read_parquet}.get(path.suffix, _read_txt)
    doc_bytes = 0
    for text, begins, ends in reader(path, cfg, stats, advance):
        if begins:
            doc_bytes = 0
        doc_bytes += len(text) if text.isascii() else len(text.encode())
        if ends:
            stats.documents += 1
            stats.long_docs += doc_bytes > LONG_DOC_BYTES
        if len(text) <= PIECE_CHARS:
            yield text, begins, ends
            continue
        start = 0
        while len(text) - start > PIECE_CHARS:
            end = _cut(text, start + PIECE_CHARS // 2, start + PIECE_CHARS)
            yield text[start:end], begins and start == 0, False
            start = end
        yield text[start:], begins and start == 0, ends


def read_documents(path: str | Path, cfg: DataConfig | None = None) -> list[str]:
    """A source file's documents as strings (whole, as the store holds them); for tests and inspection."""
    cfg = cfg or DataConfig()
    docs: list[str] = []
    current: list[str] = []
    for text, _, ends in _records(Path(path), cfg, _FileStats()):
        current.append(text)
        if ends:
            docs.append("".join(current))
            current = []
    return docs


def _file_warnings(path: Path, stats: _FileStats) -> list[str]:
    out = []
    if stats.replaced:
        out.append(f"{path}: replaced {stats.replaced:,} undecodable byte sequences with U+FFFD")
    if stats.long_docs:
        out.append(
            f"{path}: {stats.long_docs:,} documents longer than {LONG_DOC_BYTES >> 20} MiB "
            "(tokenized in pieces; is --data.separator right?)"
        )
    return out


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


def _download_tinystories() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from huggingface_hub import hf_hub_download

    repo, train, valid = TINYSTORIES
    try:
        paths = [hf_hub_download(repo, name, repo_type="dataset") for name in (train, valid)]
    except Exception as e:
        raise ConfigError(
            f"could not download TinyStories from the Hugging Face hub ({type(e).__name__}); "
            "pass local text with --data PATH [--val-data PATH]"
        ) from None
    return (paths[0],), (paths[1],)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            h.update(block)
    return h.hexdigest()


def _stat(path: Path) -> dict:
    st = path.stat()
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
        files = _files_hashes(store / "tokenizer")
    except OSError:
        files = {}
    if files != tok_meta["files"]:
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
        if old_hashes == [_sha256(f) for f in new_files]:
            for s in ("train", "val"):
                for o, n in zip(old[s], sources[s], strict=True):
                    o["mtime_ns"] = n["mtime_ns"]
            _write_json(meta_path, meta)
            return meta
    print(f"sources changed since {store} was built: tokenizing again")
    return None


def _same_files(a: dict, b: dict, keys: tuple[str, ...]) -> bool:
    pick = lambda sources: [[tuple(f[k] for k in keys) for f in sources[s]] for s in ("train", "val")]
    return pick(a) == pick(b)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def prepare(cfg: DataConfig) -> TokenStore:
    """Tokenize the corpus once into a cached token store; reuse it while sources and tokenizer are unchanged.

    The store's folder is named by what was asked for (source paths as given, tokenizer, reading options);
    its meta.json records what was found (each file's size, mtime and sha256). A later call with the same
    request reuses the store if every file still has its size and mtime (or, if only mtimes moved, its
    sha256), and otherwise rebuilds it in place."""
    train_paths, val_paths = cfg.paths, cfg.val_paths
    if not train_paths:
        train_paths, hub_val = _download_tinystories()
        val_paths = val_paths or hub_val
    train_files, val_files = resolve_files(train_paths), resolve_files(val_paths)
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
        with contextlib.closing(_records(path, cfg, _FileStats())) as records:
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
    started = time.time()
    if cfg.tokenizer == "gpt2":
        tok: Tokenizer = GPT2Tokenizer(find_gpt2_files(cfg.gpt2_dir))
    else:
        print(
            f"training a {cfg.bpe_vocab_size}-token byte-level BPE on (at most) the first "
            f"{cfg.bpe_train_bytes / 1e6:g} MB of training text"
        )
        sample = _bpe_sample(cfg, train_files, bool(val_files))
        first = next(sample, None)
        if first is None:  # no training text at all, or every document held out: say which
            n = sum(ends for f in train_files for _, _, ends in _records(f, cfg, _FileStats()))
            _check_counts(train_files, val_files, {"train": 0, "val": 0 if val_files else n})
        tok = BPETokenizer.train(itertools.chain([first], sample), cfg.bpe_vocab_size)
    tok.save(directory / "tokenizer")
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    total = sum(f["size"] for s in sources.values() for f in s)
    workers = _auto_workers(cfg.tokenize_workers, total)
    writers = {s: _SplitWriter(directory, s, dtype) for s in ("train", "val")}
    notes: list[str] = []
    encoder = _Encoder(tok, directory / "tokenizer", dtype, workers)
    try:
        with tqdm(total=total, desc="tokenize", unit="B", unit_scale=True, leave=False) as bar:
            for split, files in (("train", train_files), ("val", val_files)):
                route = _Router(None if split == "val" or val_files else cfg.val_fraction)
                for i, path in enumerate(files):
                    sources[split][i]["sha256"] = _sha256(path)
                    stats = _FileStats()
                    target = writers[split]
                    for text, begins, ends in _records(path, cfg, stats, bar.update):
                        if begins and split == "train":
                            target = writers[route(text)]
                        if target.add(text, begins, ends):
                            encoder.submit(target)
                    sources[split][i]["documents"] = stats.documents
                    notes += _file_warnings(path, stats)
            for w in writers.values():
                encoder.submit(w)
            encoder.drain()
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
    _write_json(directory / "meta.json", meta)
    return meta


# -------------------------------------------------------------------------------------------------- loading


class Windows:
    """Random-access source of packed windows: window i is tokens[i*T : i*T + T + 1].

    A memory-mapped token array is read with positional reads (os.pread) rather than through the mapping,
    so the pages a random walk touches stay in the OS page cache and never count as this process's memory.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self._file = None
        if isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap) and tokens.ndim == 1:
            self._file = (str(tokens.filename), int(tokens.offset), tokens.dtype)
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self._file[0], os.O_RDONLY) if self._file else None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_fd"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        if self._fd is None:
            return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)
        _, offset, dtype = self._file
        raw = os.pread(self._fd, (self.seq_len + 1) * dtype.itemsize, offset + start * dtype.itemsize)
        return np.frombuffer(raw, dtype).astype(np.int32)


def train_iterator(
    store: TokenStore,
    seq_len: int,
    local_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """Endless batches of (local_batch, seq_len + 1) windows: reshuffled every epoch, this process's share only.

    The iterator's `get_state()` is a small dict; `set_state()` resumes at exactly the same batch.
    """
    windows = Windows(store.tokens("train"), seq_len)
    if len(windows) < local_batch * process_count:
        raise ConfigError(
            f"training split has {len(windows)} windows of {seq_len} tokens, fewer than one global batch "
            f"({local_batch * process_count}); use more text, a smaller --batch-size or --data.seq-len"
        )
    ds = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
    ds = ds[process_index::process_count].batch(local_batch, drop_remainder=True)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))


def eval_batches(
    store: TokenStore, seq_len: int, global_batch: int, process_index: int = 0, process_count: int = 1
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The whole validation split in order, as (tokens, weight) batches; the last batch is padded with
    weight-0 rows so every batch has the same shape (one compile) and the numbers compare across runs."""
    windows = Windows(store.tokens("val"), seq_len)
    if len(windows) == 0:
        raise ConfigError(f"validation split has fewer than {seq_len + 1} tokens; add validation text")
    local = global_batch // process_count
    for start in range(0, len(windows), global_batch):
        rows = np.zeros((local, seq_len + 1), np.int32)
        weight = np.zeros((local,), np.float32)
        for r in range(local):
            i = start + process_index * local + r
            if i < len(windows):
                rows[r] = windows[i]
                weight[r] = 1.0
        yield rows, weight
