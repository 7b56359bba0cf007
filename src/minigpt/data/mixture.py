"""A run's data: one corpus, or a weighted mixture of named sources, each tokenized once into its own store.

The sources of a mixture share one tokenizer. GPT-2's is the same everywhere; a trained BPE is trained once on
an equal share of each source's text (not on the weights: re-weighting a mixture, the commonest experiment
with one, then reuses every store) and kept in the token cache, named by the sources it was trained on. The
loader samples windows from the sources at their weights (`loader.train_iterator`); evaluation reports each
source's validation bits per byte and their total (`inference.evaluate.evaluate`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

from minigpt.config import ConfigError, DataConfig, Source
from minigpt.data.build import TrainTokens, bpe_sample, prepare
from minigpt.data.corpus import resolve_files
from minigpt.data.holdout import one_text_by_paragraphs
from minigpt.data.progress import megabytes
from minigpt.data.saved_tokenizer import load_tokenizer
from minigpt.data.store import TokenStore
from minigpt.data.tokenizer import BPETokenizer, Tokenizer


@dataclasses.dataclass(frozen=True)
class Part:
    """One prepared source: its name ("" for a single corpus), token store and normalised weight."""

    name: str
    store: TokenStore
    weight: float


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The prepared sources of a run, in the order given (one for a plain --data)."""

    parts: tuple[Part, ...]

    @classmethod
    def single(cls, store: TokenStore) -> Corpus:
        """One corpus, unnamed."""
        return cls((Part("", store, 1.0),))

    @property
    def first(self) -> TokenStore:
        return self.parts[0].store

    @property
    def examples(self) -> bool:
        """Whether any source holds examples (conversations): then batches carry their flags."""
        return any(part.store.examples for part in self.parts)

    @property
    def is_mixture(self) -> bool:
        return bool(self.parts[0].name)

    def tokenizer(self) -> Tokenizer:
        return self.first.tokenizer()

    @property
    def vocab_size(self) -> int:
        return self.first.vocab_size

    def opening(self, split: str) -> str:
        """A prompt in the style of the first source (see `TokenStore.opening`)."""
        return self.first.opening(split)

    @property
    def identity(self) -> str:
        """What the tokens are made of: the store's identity for one corpus, else the named stores'."""
        return self._combined([p.store.identity for p in self.parts])

    @property
    def former_identity(self) -> str:
        """`identity` as a run recorded it before stores of examples were named by their chat template too
        (`TokenStore.former_identity`)."""
        return self._combined([p.store.former_identity for p in self.parts])

    def _combined(self, identities: list[str]) -> str:
        if not self.is_mixture:
            return identities[0]
        made_of = [(p.name, i) for p, i in zip(self.parts, identities, strict=True)]
        return hashlib.sha256(json.dumps(made_of).encode()).hexdigest()[:16]

    def check_unchanged(self) -> None:
        for part in self.parts:
            part.store.check_unchanged()

    def split_totals(self, split: str) -> dict[str, int]:
        """Documents, tokens and text bytes of a split as the stores hold them, summed over the sources."""
        keys = ("documents", "tokens", "text_bytes")
        return {k: sum(int(p.store.meta["splits"][split][k]) for p in self.parts) for k in keys}

    def extent(self) -> dict[str, dict[str, int]]:
        """The tokens per split each source is read to, by source name: what a run records so that, resumed
        after a store was extended, it reads the same windows."""
        return {p.name: {s: p.store.size(s) for s in ("train", "val")} for p in self.parts}

    def source_files(self, split: str) -> list[dict]:
        """Every source file of a split (as the stores recorded them), source after source."""
        return [f for p in self.parts for f in p.store.meta["sources"][split]]


def prepare_corpus(
    cfg: DataConfig, train_tokens: TrainTokens = None, extent: dict[str, dict[str, int]] | None = None
) -> Corpus:
    """Tokenize (once) every source of the data config into its own cached store: all of it, or (given the
    `train_tokens` a run reads, or a function that works them out) each source's share by weight, and at
    least the `extent` a run recorded, which it is then read to (see `Corpus.extent`)."""
    sources = cfg.sources()
    tokenizer = shared_tokenizer(cfg, sources) if sources[0].name and cfg.tokenizer == "bpe" else None
    parts = []
    for source in sources:
        if source.name:
            print(f"source {source.name} (weight {source.weight:.3g}):")
        recorded = (extent or {}).get(source.name)
        need = functools.partial(_share, train_tokens, source.weight, recorded)
        store = prepare(_source_config(cfg, source) if source.name else cfg, tokenizer, need)
        if recorded is not None:
            store = store.limited(recorded)
        parts.append(Part(source.name, store, source.weight))
    return Corpus(tuple(parts))


def _share(train_tokens: TrainTokens, weight: float, recorded: dict[str, int] | None) -> int | None:
    """A source's training tokens: its weight's share of the run's, at least what the run recorded."""
    total = train_tokens() if callable(train_tokens) else train_tokens
    need = None if total is None else math.ceil(total * weight)
    return need if recorded is None else max(need or 0, recorded["train"])


def _source_config(cfg: DataConfig, source: Source) -> DataConfig:
    return dataclasses.replace(cfg, paths=source.paths, val_paths=source.val_paths)


def _size_and_mtime(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def shared_tokenizer(cfg: DataConfig, sources: tuple[Source, ...]) -> Tokenizer:
    """The mixture's BPE: trained on the first bpe_train_bytes / n of each of the n sources' training
    documents, cached under the token cache by the sources' files (paths, sizes, mtimes) and settings."""
    found = [resolve_files(s.paths) for s in sources]
    val_found = [resolve_files(s.val_paths, "--val-data") for s in sources]
    key_src = {
        "files": [[(str(f), *_size_and_mtime(f)) for f in fs] for fs in found],
        "held_out": [bool(s.val_paths) for s in sources],
        "vocab": cfg.bpe_vocab_size,
        "bytes": cfg.bpe_train_bytes,
        "options": [cfg.separator, cfg.text_field, cfg.encoding_errors, cfg.val_fraction],
    }
    key = hashlib.sha256(json.dumps(key_src).encode()).hexdigest()[:16]
    directory = cfg.cache() / "tokens" / f"mixture-{key}" / "tokenizer"
    try:
        return load_tokenizer(directory)
    except ConfigError:  # not trained yet (or cut short before its marker file was written)
        pass
    share = max(1, cfg.bpe_train_bytes // len(sources))
    print(
        f"training a {cfg.bpe_vocab_size}-token BPE shared by the mixture on {megabytes(share)} of each source"
    )
    sample_cfg = dataclasses.replace(cfg, bpe_train_bytes=share)
    read = [0]
    texts: Iterator[str] = itertools.chain.from_iterable(
        bpe_sample(one_text_by_paragraphs(sample_cfg, fs, vs, say=False), fs, bool(vs), read)
        for fs, vs in zip(found, val_found, strict=True)
    )
    tok = BPETokenizer.train(texts, cfg.bpe_vocab_size, read_bytes=lambda: read[0])
    tok.save(directory)
    return tok
