"""The token store: a corpus tokenized once into files on disk, and read from there while its sources are unchanged.

Per split, a store holds a flat token file with an end-of-text token after each document (`{split}.bin`) and
the documents' start offsets (`{split}.docs.npy`); its tokenizer sits in tokenizer/, and meta.json records what
it was made of (each source file's size, mtime and sha256, the tokenizer, the reading options). meta.json is
written last, so a folder without it holds no store. A store may be a paused build ("complete": false): the
first tokens of its corpus, enough for the runs so far, extended in place (only ever appended to) when a run
needs more. `reusable` says whether a store on disk is still the one a request asks for; `minigpt.data.build`
makes stores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from minigpt.config import ConfigError
from minigpt.data import packing
from minigpt.data.corpus import BLOCK_BYTES, os_reason
from minigpt.data.saved_tokenizer import load_tokenizer
from minigpt.data.tokenizer import Tokenizer
from minigpt.runtime import files

STORE_VERSION = 2
"""The store layout's version: a store of another version is rebuilt."""


@dataclasses.dataclass(frozen=True)
class TokenStore:
    """A prepared corpus on disk: `{split}.bin` token arrays, `{split}.docs.npy` document starts, meta.json.

    `extent`, if set, is the tokens per split this reader keeps to (a run's recorded extent): the first ones
    of a store extended since, so a resumed run reads what it read before."""

    path: Path
    meta: dict
    extent: dict[str, int] | None = None
    own_tokenizer: Tokenizer | None = dataclasses.field(default=None, compare=False)
    """The tokenizer the request named, where it was a checkpoint's: the same tokens as the store's saved one,
    with its own chat template (a store of text is shared by checkpoints that differ only in that)."""

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def examples(self) -> bool:
        """Whether the store holds training examples (conversations) with flags in their tokens
        (`minigpt.data.packing`), rather than text."""
        return bool(self.meta.get("examples", False))

    @property
    def complete(self) -> bool:
        """Whether the store holds its whole corpus (not a paused build's first tokens)."""
        return bool(self.meta.get("complete", True))

    def size(self, split: str) -> int:
        """Tokens of the split this reader reads: its extent, else all the store holds."""
        return int(self.extent[split] if self.extent else self.meta["splits"][split]["tokens"])

    def limited(self, extent: dict[str, int]) -> TokenStore:
        """This store read only up to `extent` (tokens per split), which it must hold."""
        for split, n in extent.items():
            if n > self.meta["splits"][split]["tokens"]:
                raise ConfigError(
                    f"token store {self.path} holds {self.meta['splits'][split]['tokens']:,} {split} tokens, "
                    f"fewer than the {n:,} the run read; delete the folder to build it again"
                )
        return dataclasses.replace(self, extent=dict(extent))

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens as a read-only memory map: nothing is loaded until it is indexed. Only the
        first `size(split)`: a paused build's files may be longer while another process extends them."""
        shape = None if self.extent is None and self.complete else (self.size(split),)
        return np.memmap(self.path / f"{split}.bin", dtype=self.dtype, mode="r", shape=shape)

    def chunk_check(self, split: str) -> ChunkCheck | None:
        """What checks the split's token file as it is read; None for a store built before chunk digests."""
        return ChunkCheck(self, split) if "chunks" in self.meta.get("splits", {}).get(split, {}) else None

    def doc_starts(self, split: str) -> np.ndarray:
        starts = np.load(self.path / f"{split}.docs.npy", mmap_mode="r")
        if self.extent is None and self.complete:
            return starts
        return starts[: int(np.searchsorted(starts, self.size(split)))]

    def tokenizer(self) -> Tokenizer:
        return self.own_tokenizer or load_tokenizer(self.path / "tokenizer")

    def opening(self, split: str, words: int = 6) -> str:
        """The first `words` words of the split's first document that has any: a prompt in the corpus's own
        style (a story's opening for TinyStories, a sentence of a book for Gutenberg)."""
        tokens, starts, tok = self.tokens(split), self.doc_starts(split), self.tokenizer()
        ends = [*starts[1:], len(tokens)]
        fallback = ""
        for start, end in zip(starts[:64], ends[:64], strict=False):
            stop = min(end, start + 16 * words)
            ids = np.asarray(tokens[start:stop], np.int64) & packing.ID_MASK  # without an example's flags
            found = tok.decode(ids.tolist()).replace("<|endoftext|>", " ").split()
            # A document cut short may end in part of a word; one of a word or two (a split's cut-off "?")
            # is a prompt only if no other document has more.
            opening = " ".join(found[: words if stop == end else min(words, len(found) - 1)] or found[:1])
            if len(found) >= 3:
                return opening
            fallback = fallback or opening
        return fallback

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def identity(self) -> str:
        """What the tokens are made of (see `store_identity`), as recorded when the store was first made: a
        paused build keeps it when it is extended, since the tokens a run read stay as they were."""
        return self.meta.get("identity") or store_identity(self.meta)

    @property
    def former_identity(self) -> str:
        """The identity this store had before a store of examples was named by its chat template too: what
        runs recorded then (their resume and evaluation are checked as before)."""
        options = {k: v for k, v in self.meta["options"].items() if k != "rendering"}
        return store_identity({**self.meta, "options": options})

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


def store_identity(meta: dict) -> str:
    """Each source file's content hash, the tokenizer's files and the reading options: two stores with one
    identity hold the same tokens, wherever they are. A file a paused build has not read yet counts by its
    hub revision or its path, size and modification time."""

    def content(f: dict) -> str | list:
        return f.get("sha256") or f.get("hub") or [f["path"], f["size"], f["mtime_ns"]]

    made_of = {
        "sources": {s: [content(f) for f in meta["sources"][s]] for s in ("train", "val")},
        "tokenizer": meta["tokenizer"]["files"],
        "options": meta["options"],
    }
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:16]


def sha256_of(*paths: Path | tuple[Path, int]) -> str:
    """sha256 (hex) of the files' bytes, one after another; a (path, n) pair stands for the file's first n
    bytes (what a build recorded of a token file that a later build may have extended)."""
    h = hashlib.sha256()
    for item in paths:
        path, left = item if isinstance(item, tuple) else (item, None)
        try:
            with open(path, "rb") as f:
                while (left is None or left > 0) and (block := f.read(min(left or BLOCK_BYTES, BLOCK_BYTES))):
                    h.update(block)
                    left = None if left is None else left - len(block)
        except OSError as e:
            raise ConfigError(f"{path} could not be read ({os_reason(e)})") from None
    return h.hexdigest()


CHUNK_BYTES = 1 << 20
"""A token file's bytes are digested per chunk of this size, so a reader can check each chunk as it first
reads it (one digest costs about a millisecond) instead of hashing the whole file first."""


def chunk_digests(path: Path, nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """blake2b-128 (hex) of each `chunk_bytes` chunk of the file's first `nbytes` (the last one shorter)."""
    out = []
    try:
        with open(path, "rb") as f:
            for start in range(0, nbytes, chunk_bytes):
                out.append(
                    hashlib.blake2b(f.read(min(chunk_bytes, nbytes - start)), digest_size=16).hexdigest()
                )
    except OSError as e:
        raise ConfigError(f"{path} could not be read ({os_reason(e)})") from None
    return out


class ChunkCheck:
    """Checks the chunks of a token file a reader reads against the digests its store recorded, each chunk
    the first time this process reads from it: damage after the build (bytes copied over others, say) is
    found before a batch of it is trained on or evaluated, at a cost spread over the first reads."""

    def __init__(self, store: TokenStore, split: str) -> None:
        info = store.meta["splits"][split]
        self.path, self.split = store.path / f"{split}.bin", split
        self.chunk_bytes, self.digests = int(info["chunks"]["bytes"]), list(info["chunks"]["blake2b"])
        self.nbytes = int(info["tokens"]) * np.dtype(store.meta["dtype"]).itemsize
        self.checked = bytearray(len(self.digests))

    def read(self, start: int, stop: int) -> None:
        """Check the chunks that bytes [start, stop) of the file fall in, if not yet checked."""
        last = min((stop - 1) // self.chunk_bytes, len(self.digests) - 1)
        for c in range(start // self.chunk_bytes, last + 1):
            if not self.checked[c]:
                self._check(c)

    def _check(self, c: int) -> None:
        begin = c * self.chunk_bytes
        try:
            with open(self.path, "rb") as f:
                f.seek(begin)
                data = f.read(min(self.chunk_bytes, self.nbytes - begin))
        except OSError as e:
            raise ConfigError(f"{self.path} could not be read ({os_reason(e)})") from None
        if hashlib.blake2b(data, digest_size=16).hexdigest() != self.digests[c]:
            raise ConfigError(
                f"token store {self.path.parent}: {self.split}.bin bytes {begin:,}-{begin + len(data):,} differ "
                "from the digest its build recorded (the file was changed since); delete the folder and "
                "`minigpt prepare` with the same --data flags rebuilds it"
            )
        self.checked[c] = 1


def files_hashes(directory: Path) -> dict[str, str]:
    """sha256 (hex) of each file in `directory` by name: what meta.json records of a store's tokenizer."""
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir()) if f.is_file()
    }


def reusable(store: Path, request: str, sources: dict[str, list[dict]]) -> dict | None:
    """The store's meta if it is complete or a paused build, made by the requested tokenizer and from
    unchanged sources (files a paused build has not read yet are not hashed)."""
    meta_path = store / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None  # absent, or half-written (killed mid-prepare: meta.json is written last)
    if "complete" not in meta or meta.get("version") != STORE_VERSION or "tokenizer" not in meta:
        return None
    tok_meta = meta["tokenizer"]
    if tok_meta["request"] != request:
        raise ConfigError(
            f"token store {store} holds tokens of tokenizer {tok_meta['identity']}, but the config asks for "
            f"{request}; delete the folder to rebuild it"
        )
    try:
        tokenizer_files = files_hashes(store / "tokenizer")
    except OSError:
        tokenizer_files = {}
    if tokenizer_files != tok_meta["files"]:
        raise ConfigError(
            f"token store {store}: tokenizer/ is not the tokenizer its tokens were made with "
            f"({tok_meta['identity']}); delete the folder to rebuild it"
        )
    old = meta["sources"]
    if same_files(old, sources, ("path", "size", "mtime_ns")):
        return meta
    if same_files(old, sources, ("path", "size")):
        # Touched but maybe not changed (a copy, a checkout): compare contents before re-tokenizing.
        pairs = [(o, n) for s in ("train", "val") for o, n in zip(old[s], sources[s], strict=True)]
        if all("sha256" not in o or o["sha256"] == sha256_of(Path(n["path"])) for o, n in pairs):
            for s in ("train", "val"):
                for o, n in zip(old[s], sources[s], strict=True):
                    o["mtime_ns"] = n["mtime_ns"]
            files.write_json(meta_path, meta)
            return meta
    print(f"sources changed since {store} was built: tokenizing again")
    return None


def same_files(a: dict, b: dict, keys: tuple[str, ...]) -> bool:
    """Whether two `sources` records (per split, one dict per file) agree on `keys` for every file."""
    pick = lambda sources: [[tuple(f[k] for k in keys) for f in sources[s]] for s in ("train", "val")]
    return pick(a) == pick(b)
