"""The journal of a store being built: how far tokenizing got, so a build stopped at any moment (a kill, a lost
machine, or a pause once a run's tokens are in) continues from there, and only over the bytes it read before.

journal.json records the build's state (see `build._Pass`) with, for each source file, a digest of the bytes
read so far: the whole file's sha256 once it is read, and a running sha256 of the part read of the file being
read. A build continues only if those bytes are still the same; an edit in place that keeps a file's size and
modification time is found too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np

from minigpt.config import ConfigError
from minigpt.data.corpus import BLOCK_BYTES, open_binary
from minigpt.data.encode import SplitWriter
from minigpt.data.ranged import RangedFile
from minigpt.data.store import STORE_VERSION, files_hashes, same_files, sha256_of
from minigpt.runtime import files


class Journal:
    """journal.json in a store being built, replaced atomically, so a build killed at any moment continues
    from its last journal, not from zero; brought up to date at most every `every` seconds."""

    def __init__(self, directory: Path, dtype: np.dtype, every: float) -> None:
        self.path = directory / "journal.json"
        # What must not have changed to continue: the store's version and tokenizer (checked by
        # not_resumable), and the token type the lengths count in.
        tokenizer = files_hashes(directory / "tokenizer")
        self.fixed = {"version": STORE_VERSION, "tokenizer": tokenizer, "dtype": dtype.name}
        self.last, self.every = time.monotonic(), every

    def due(self) -> bool:
        """True at most once every `every` seconds."""
        if time.monotonic() - self.last < self.every:
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


class PrefixHash:
    """sha256 of a source file's first bytes, brought forward as reading goes on: each call reads only the
    bytes added since the last (from the page cache, just read by the tokenizing pass)."""

    def __init__(self, path: Path) -> None:
        self.path, self.hash, self.done = path, hashlib.sha256(), 0

    def upto(self, n: int) -> str:
        with open_binary(self.path) as f:  # a hub file fetched by range: what has arrived
            f.seek(self.done)
            while self.done < n and (block := f.read(min(BLOCK_BYTES, n - self.done))):
                self.hash.update(block)
                self.done += len(block)
        return self.hash.hexdigest()


def read_extent(path: Path, point: dict | None) -> int:
    """The bytes of a file a reader stopped at `point` has read: the bytes before the point (a Parquet file's
    row groups are read where they lie: all of it)."""
    if point is None:
        return 0
    return Path(path).stat().st_size if Path(path).suffix == ".parquet" else int(point["bytes"])


def interrupted(
    directory: Path, sources: dict[str, list[dict]], paths: dict[str, list[Path]], clear: bool = True
) -> dict | None:
    """The journal of an interrupted (or paused) build in `directory` if it can be continued (`paths`: the
    source files, read to check); otherwise None, and, if `clear`, `directory` emptied for a build from
    scratch."""
    saved, why = None, None
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads((directory / "journal.json").read_text())
    if saved is not None:
        try:
            why = not_resumable(directory, saved, sources, paths)
        except (KeyError, TypeError, AttributeError):  # not a journal this version writes
            why = "its journal is not one this version of minigpt reads"
        except ConfigError as e:  # a source file read before can no longer be read
            why = str(e)
        if why is None:
            return saved
        print(f"not continuing the build in {directory}: {why}; starting over")
    if clear:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    return None


def not_resumable(
    directory: Path, saved: dict, sources: dict[str, list[dict]], paths: dict[str, list[Path]]
) -> str | None:
    """Why the journaled build cannot be continued, or None if it can."""
    if saved.get("version") != STORE_VERSION:
        return "it was made by another version of minigpt"
    if not same_files(saved["sources"], sources, ("path", "size")):
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
    return _changed_bytes(saved, paths)


def _changed_bytes(saved: dict, paths: dict[str, list[Path]]) -> str | None:
    """Which source file's bytes read so far changed since they were journaled (an edit in place keeps size
    and modification time): each file read whole against its sha256, the one being read against the digest
    of its part read. That file's sha256 is taken again: the text after the part read is read from it now."""
    at, order = saved["at"], [(s, i) for s in ("val", "train") for i in range(len(saved["sources"][s]))]
    for split, i in order[: order.index((at["split"], at["file"])) + 1]:
        source = saved["sources"][split][i]
        if (split, i) != (at["split"], at["file"]):
            if sha256_of(paths[split][i]) != source["sha256"]:
                return f"{source['path']} changed since it was read"
        elif at["point"] is not None:
            prefix = saved["prefix"]
            path = paths[split][i]
            if PrefixHash(path).upto(prefix["bytes"]) != prefix["sha256"]:
                return f"{source['path']} changed in the part already read"
            source["sha256"] = path.sha256 if isinstance(path, RangedFile) else sha256_of(path)
    return None
