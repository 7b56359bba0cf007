"""Which documents are held out for validation (a deterministic fraction, by content hash; of a single text
with no documents marked in it, its paragraphs), and which validation documents also occur in the training
text (warned about when most do)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from minigpt.config import ConfigError, DataConfig
from minigpt.data import hub, ranged
from minigpt.data.corpus import BLOCK_BYTES, open_binary, os_reason
from minigpt.data.tokenizer import EOT

OVERLAP_MAX_DOCS = 500_000
"""Validation documents are looked up in the training text if there are at most this many (each costs some
80 bytes of memory while tokenizing)."""


def one_text_by_paragraphs(
    cfg: DataConfig, train_files: list[Path], val_files: list[Path], say: bool = True
) -> DataConfig:
    """`cfg`, or, for a single plain text file (a book) without <|endoftext|> and without validation files,
    which would be one document none of which could be held out, `cfg` reading it by blank-line paragraphs:
    said first (`say`), since its documents (and what validation holds) are then paragraphs."""
    if val_files or cfg.separator != "eot" or len(train_files) != 1:
        return cfg
    path = train_files[0]
    if path.suffix in (".jsonl", ".parquet") or isinstance(path, (hub.HubFile, ranged.RangedFile)):
        return cfg
    if _holds(path, EOT.encode()):
        return cfg
    if say:
        print(
            f"{path.name} has no {EOT} lines: its blank-line paragraphs are its documents, "
            f"{cfg.val_fraction:.0%} of them held out for validation (as --data.separator blank-line; "
            "--val-data FILE keeps it whole)"
        )
    return dataclasses.replace(cfg, separator="blank-line")


def _holds(path: Path, marker: bytes) -> bool:
    """Whether the file's bytes hold `marker` anywhere, read block by block."""
    tail = b""
    try:
        with open_binary(path) as f:
            while block := f.read(BLOCK_BYTES):
                if marker in tail + block:
                    return True
                tail = block[-(len(marker) - 1) :]
    except OSError as e:
        raise ConfigError(f"{path} could not be read ({os_reason(e)})") from None
    return False


class Router:
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


class Overlap:
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
