"""The Grain loader: packed windows of a token store's split, shuffled for training or in order for evaluation.

Documents are concatenated with an end-of-text token after each one and cut into windows of seq_len + 1
tokens with stride seq_len. Nothing is padded, so no compute and no loss is spent on pad positions, and every
token is a training target exactly once per epoch.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import grain
import numpy as np

from minigpt.config import ConfigError
from minigpt.data import packing

if TYPE_CHECKING:
    from minigpt.data.store import ChunkCheck, TokenStore


class Windows:
    """Random-access source of packed windows: window i is tokens[i*T : i*T + T + 1].

    A memory-mapped token array is read with positional reads (os.pread) rather than through the mapping,
    so the pages a random walk touches stay in the OS page cache and never count as this process's memory.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, check: ChunkCheck | None = None) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.check = check
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
        return self._read(i * self.seq_len)

    def _read(self, start: int, n: int | None = None) -> np.ndarray:
        """Tokens [start, start + n) as int32; n is seq_len + 1 unless given."""
        n = self.seq_len + 1 if n is None else n
        if self.check is not None:
            itemsize = self.tokens.dtype.itemsize
            self.check.read(start * itemsize, (start + n) * itemsize)
        if self._fd is None:
            return np.asarray(self.tokens[start : start + n], dtype=np.int32)
        _, offset, dtype = self._file
        raw = os.pread(self._fd, n * dtype.itemsize, offset + start * dtype.itemsize)
        return np.frombuffer(raw, dtype).astype(np.int32)


class DocumentWindows(Windows):
    """Windows of seq_len + 1 tokens that begin at a document: at the end-of-text token before it (the
    document's beginning-of-sequence), and every seq_len tokens further while the document lasts."""

    def __init__(
        self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, check: ChunkCheck | None = None
    ) -> None:
        super().__init__(tokens, seq_len, check)
        n = len(tokens)
        starts = np.maximum(np.asarray(doc_starts, np.int64) - 1, 0)
        ends = np.append(starts[1:], n - 1)
        per_doc = np.maximum(1, -(-(ends - starts) // seq_len))  # ceil: a long document's later windows
        first = np.repeat(starts, per_doc)
        k = np.arange(len(first)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
        # The last windows are moved back to fit in the split (they then begin inside a document).
        self.starts = np.minimum(first + k * seq_len, max(0, n - seq_len - 1))

    def __len__(self) -> int:
        return len(self.starts) if len(self.tokens) > self.seq_len else 0

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        return self._read(int(self.starts[i]))


class PackedExamples(Windows):
    """Rows of seq_len + 1 tokens, each holding whole examples of a store of examples (`minigpt.data.packing`):
    packed best-fit, padded, an example longer than a row cut to its first seq_len + 1 tokens. The packing is
    fixed; training shuffles the rows every epoch."""

    def __init__(
        self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, check: ChunkCheck | None = None
    ) -> None:
        super().__init__(tokens, seq_len, check)
        starts = np.asarray(doc_starts, np.int64)
        lengths = np.diff(starts, append=len(tokens))
        self.cut = int((lengths > seq_len + 1).sum())
        self.starts, self.lengths = starts, np.minimum(lengths, seq_len + 1)
        self.rows = packing.pack(self.lengths, seq_len + 1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range [0, {len(self)})")
        out = np.full(self.seq_len + 1, packing.PAD, np.int32)
        at = 0
        for e in self.rows[i]:
            n = int(self.lengths[e])
            out[at : at + n] = self._read(int(self.starts[e]), n)
            at += n
        return out

    def summary(self, split: str) -> str:
        """What packing made of the split, and how many examples it cut, in a line."""
        padding = 1 - self.lengths.sum() / max(1, len(self.rows) * (self.seq_len + 1))
        line = (
            f"{split}: {len(self.lengths):,} examples packed into {len(self.rows):,} rows of {self.seq_len + 1} "
            f"tokens ({padding:.0%} padding)"
        )
        if self.cut:
            line += (
                f"; {self.cut:,} longer than a row cut to their first {self.seq_len + 1} tokens (a larger "
                "--data.seq-len keeps them whole)"
            )
        return line


def _windows(store: TokenStore, seq_len: int, window_start: str) -> Windows:
    check = store.chunk_check("train")
    if store.examples:
        return PackedExamples(store.tokens("train"), store.doc_starts("train"), seq_len, check)
    if window_start == "document":
        return DocumentWindows(store.tokens("train"), store.doc_starts("train"), seq_len, check)
    return Windows(store.tokens("train"), seq_len, check)


def train_rows(store: TokenStore, seq_len: int) -> float:
    """Rows of seq_len + 1 tokens in one pass over the training split: its packed rows of examples, or, for
    text, its tokens over seq_len."""
    if store.examples:
        return len(PackedExamples(store.tokens("train"), store.doc_starts("train"), seq_len))
    return store.size("train") / seq_len


def train_iterator(
    stores: TokenStore | Sequence[TokenStore],
    seq_len: int,
    local_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    *,
    weights: Sequence[float] = (),
    window_start: str = "anywhere",
) -> grain.DatasetIterator:
    """Endless batches of (local_batch, seq_len + 1) windows: reshuffled every epoch, this process's share only.

    Several stores are mixed window by window at their weights, deterministically (Grain's mix: the same
    sources and weights give the same interleaving), each source reshuffled every epoch on its own, so a
    smaller source repeats more often. The iterator's `get_state()` is a small dict; `restore_position` (or
    `set_state()`) resumes at exactly the same batch.
    """
    stores = list(stores) if isinstance(stores, Sequence) else [stores]
    sources = []
    for i, store in enumerate(stores):
        windows = _windows(store, seq_len, window_start)
        if len(windows) == 0 or (len(stores) == 1 and len(windows) < local_batch * process_count):
            raise ConfigError(
                f"the training text ({sources_named(store, 'train')}) makes {len(windows)} windows of {seq_len} "
                "tokens, fewer than "
                f"one global batch ({local_batch * process_count}); use more text, a smaller --batch-size or "
                "--data.seq-len"
            )
        if isinstance(windows, PackedExamples) and process_index == 0:
            print(windows.summary(f"training {sources_named(store, 'train')}"))
        sources.append(grain.MapDataset.source(windows).shuffle(seed=seed + i).repeat())
    ds = sources[0] if len(sources) == 1 else grain.MapDataset.mix(sources, list(weights))
    ds = ds[process_index::process_count].batch(local_batch, drop_remainder=True)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))


def sources_named(store: TokenStore, split: str) -> str:
    """The files (or hub datasets) a store's split was made from, as a user named them, for an error."""
    names = [f.get("hub") or f.get("path", "?") for f in store.meta.get("sources", {}).get(split, [])]
    if not names:
        return f"held out of the training text of {sources_named(store, 'train')}" if split == "val" else "?"
    return ", ".join(map(str, names[:2])) + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def restore_position(iterator: grain.DatasetIterator, state: dict) -> None:
    """Resume `iterator` (a `train_iterator`) at the position `state` (its `get_state()`, as a checkpoint
    saved it). A state this pipeline cannot take (keys it does not have, or lacks: a checkpoint written by
    another minigpt or Grain version) is a one-line ConfigError, not an error deep inside Grain."""
    expected = iterator.get_state()

    def refuse(why: str) -> ConfigError:
        return ConfigError(
            f"the checkpoint's data position {_shown_state(state)} cannot be restored ({why}): it was written by "
            "another version of minigpt's data pipeline; resume with that version, or start again with --overwrite"
        )

    if not isinstance(state, dict):
        raise refuse(f"it is a {type(state).__name__}, not a dict")
    missing, unknown = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unknown:
        names = [f"no {k!r}" for k in missing] + [f"unknown {k!r}" for k in unknown]
        raise refuse(", ".join(names))
    try:
        iterator.set_state(state)
    except Exception as e:  # Grain raises KeyError, TypeError, IndexError, ... for states it cannot take
        text = str(e).strip()
        if len(text) > 1 and text[0] == text[-1] in "'\"" and text[0] not in text[1:-1]:  # repr()-quoted
            text = text[1:-1]
        raise refuse(f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__) from None


def _shown_state(state: object) -> str:
    text = repr(state)
    return text if len(text) <= 80 else text[:77] + "..."


def eval_batches(
    store: TokenStore, seq_len: int, global_batch: int, process_index: int = 0, process_count: int = 1
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The whole validation split in order, as (tokens, weight) batches; the last batch is padded with
    weight-0 rows so every batch has the same shape (one compile) and the numbers compare across runs."""
    args = store.tokens("val"), seq_len, store.chunk_check("val")
    windows = (
        PackedExamples(args[0], store.doc_starts("val"), *args[1:]) if store.examples else Windows(*args)
    )
    if len(windows) == 0:
        raise ConfigError(
            f"the validation text ({sources_named(store, 'val')}) has fewer than {seq_len + 1} tokens; add "
            "validation text (--val-data) or a smaller --data.seq-len"
        )
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
