"""Text corpus -> token store (tokenized once, memory-mapped) -> Grain pipeline of packed windows.

Documents are concatenated with an end-of-text token after each one and cut into windows of seq_len + 1
tokens with stride seq_len. Nothing is padded, so no compute and no loss is spent on pad positions, and every
token is a training target exactly once per epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np
from tqdm import tqdm

from minigpt.config import ConfigError, DataConfig
from minigpt.tokenizer import EOT, BPETokenizer, GPT2Tokenizer, Tokenizer, find_gpt2_files, load_tokenizer

TINYSTORIES = ("roneneldan/TinyStories", "TinyStories-train.txt", "TinyStories-valid.txt")
STORE_VERSION = 1


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
        return np.load(self.path / f"{split}.docs.npy")

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.path / "tokenizer")

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def resolve_files(paths: tuple[str, ...]) -> list[Path]:
    """Expand files and folders (recursively, *.txt) into a sorted file list; missing paths are errors."""
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            found = sorted(f for f in path.rglob("*.txt") if f.is_file())
            if not found:
                raise ConfigError(f"folder {path} holds no .txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"data path not found: {path}")
    return files


def read_documents(path: Path) -> list[str]:
    """Split a UTF-8 text file into documents at <|endoftext|> markers; refuse binary or non-UTF-8 files."""
    raw = path.read_bytes()
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise ConfigError(f"{path} is not a text file (NUL byte at offset {nul})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not valid UTF-8 (bad byte at offset {e.start})") from None
    return [doc.strip() for doc in text.split(EOT) if doc.strip()]


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


def _fingerprint(files: list[Path]) -> list[dict]:
    return [
        {"path": str(f.resolve()), "size": f.stat().st_size, "mtime": f.stat().st_mtime_ns} for f in files
    ]


def _write_split(store: Path, split: str, docs: list[str], tok: Tokenizer, dtype: np.dtype) -> dict:
    """Tokenize documents in chunks (the tokenizers parallelize internally) and write tokens + doc starts."""
    chunk = 2048
    starts = np.zeros(len(docs), np.int64)
    n_tokens = 0
    n_bytes = 0
    tmp = store / f"{split}.bin.tmp"
    with (
        open(tmp, "wb") as f,
        tqdm(total=len(docs), desc=f"tokenize {split}", unit="doc", leave=False) as bar,
    ):
        for i in range(0, len(docs), chunk):
            batch = docs[i : i + chunk]
            for j, ids in enumerate(tok.encode_batch(batch)):
                starts[i + j] = n_tokens
                ids.append(tok.eot_id)
                np.asarray(ids, dtype).tofile(f)
                n_tokens += len(ids)
            n_bytes += sum(len(d.encode()) for d in batch)
            bar.update(len(batch))
    os.replace(tmp, store / f"{split}.bin")
    np.save(store / f"{split}.docs.npy", starts)
    return {"documents": len(docs), "tokens": n_tokens, "text_bytes": n_bytes}


def prepare(cfg: DataConfig) -> TokenStore:
    """Tokenize the corpus once into a cached token store; reuse it while sources and tokenizer are unchanged."""
    train_paths, val_paths = cfg.paths, cfg.val_paths
    if not train_paths:
        train_paths, hub_val = _download_tinystories()
        val_paths = val_paths or hub_val
    train_files, val_files = resolve_files(train_paths), resolve_files(val_paths)
    key_src = {
        "version": STORE_VERSION,
        "train": _fingerprint(train_files),
        "val": _fingerprint(val_files),
        "val_fraction": None if val_files else cfg.val_fraction,
        "tokenizer": cfg.tokenizer if cfg.tokenizer == "gpt2" else f"bpe{cfg.bpe_vocab_size}",
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    store = Path(cfg.cache_dir).expanduser() / "tokens" / key
    meta_path = store / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("complete"):
            return TokenStore(store, meta)
    # Absent or half-written (killed mid-prepare: meta.json is written last): build from scratch.
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)

    train_docs = [d for f in train_files for d in read_documents(f)]
    if not train_docs:
        raise ConfigError(f"training corpus is empty: no text in {', '.join(map(str, train_files))}")
    if val_files:
        val_docs = [d for f in val_files for d in read_documents(f)]
        if not val_docs:
            raise ConfigError(f"validation corpus is empty: no text in {', '.join(map(str, val_files))}")
    else:
        if len(train_docs) < 2:
            raise ConfigError("need at least 2 documents to hold some out for validation, or pass --val-data")
        held_out = np.random.default_rng(0).random(len(train_docs)) < cfg.val_fraction
        held_out[0] = True  # at least one validation document, however small the corpus
        val_docs = [d for d, h in zip(train_docs, held_out, strict=True) if h]
        train_docs = [d for d, h in zip(train_docs, held_out, strict=True) if not h]

    if cfg.tokenizer == "gpt2":
        tok: Tokenizer = GPT2Tokenizer(find_gpt2_files(cfg.gpt2_dir))
    else:
        print(f"training a {cfg.bpe_vocab_size}-token byte-level BPE on {len(train_docs)} documents")
        tok = BPETokenizer.train(train_docs, cfg.bpe_vocab_size)
    tok.save(store / "tokenizer")
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    splits = {
        "train": _write_split(store, "train", train_docs, tok, dtype),
        "val": _write_split(store, "val", val_docs, tok, dtype),
    }
    meta = {
        **key_src,
        "tokenizer_identity": tok.identity,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "splits": splits,
        "complete": True,
    }
    tmp = store / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, meta_path)
    return TokenStore(store, meta)


class Windows:
    """Random-access source of packed windows: window i is tokens[i*T : i*T + T + 1]."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)


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
