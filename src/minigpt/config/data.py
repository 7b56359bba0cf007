"""Where text comes from and how it becomes tokens (`--data`, `--val-data`, `--data.*`): sources and
mixtures, the tokenizer, the token cache, and how windows are cut."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Annotated, Literal

import tyro

from minigpt.config.fields import resume_safe
from minigpt.runtime.errors import ConfigError, check
from minigpt.runtime.files import user_cache_dir

_NAMED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)=(?P<rest>.+)")
_WEIGHT = re.compile(
    r"(?P<path>.+):(?P<weight>[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[-+]?[0-9]+)?|nan|inf(?:inity)?))", re.I
)  # anything a user may have meant as a number, so a bad weight is named as one, not as a missing path


def _named(item: str) -> re.Match | None:
    """NAME=PATH's parts, unless `item` is an existing file or folder: a real `k=v.txt` is a path."""
    return None if Path(item).expanduser().exists() else _NAMED.fullmatch(item)


@dataclasses.dataclass(frozen=True)
class Source:
    """One named source of a mixture: its training paths, mixture weight (normalised) and validation paths."""

    name: str
    paths: tuple[str, ...]
    weight: float = 1.0
    val_paths: tuple[str, ...] = ()


def _parse_named(items: tuple[str, ...], flag: str, weighted: bool) -> dict[str, tuple[str, float]] | None:
    """NAME=PATH[:WEIGHT] items as {name: (path, weight)}; None when no item is named (one plain source)."""
    named = [_named(item) for item in items]
    if not any(named):
        return None
    if not all(named):
        plain = items[named.index(None)]
        raise ConfigError(
            f"{flag} mixes named sources (NAME=PATH) with a plain path ({plain}); name every one"
        )
    out: dict[str, tuple[str, float]] = {}
    for m in named:
        path, weight = m["rest"], 1.0
        w = _WEIGHT.fullmatch(path) if weighted and not Path(path).expanduser().exists() else None
        if w is not None:
            path, weight = w["path"], float(w["weight"])
            check(
                math.isfinite(weight) and weight > 0,
                f"{flag} {m.group(0)}: the weight of source {m['name']!r} must be a finite positive number, "
                f"got {w['weight']}",
            )
        check(m["name"] not in out, f"{flag} names source {m['name']!r} twice; give each source one entry")
        out[m["name"]] = (path, weight)
    return out


def _absolute_item(item: str) -> str:
    """A --data item with its path made absolute (a source's name and weight kept; hub names as they are)."""
    m = _named(item)
    name, path = (m["name"] + "=", m["rest"]) if m else ("", item)
    return name + (path if path.startswith("hf:") else str(Path(path).expanduser().absolute()))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes tokens."""

    paths: Annotated[tuple[str, ...], tyro.conf.arg(name="data", prefix_name=False)] = ()
    """Training text: .txt, .jsonl or .parquet files, folders of them, or glob patterns ('shards/*.jsonl'), or
    a Hugging Face hub dataset, hf:OWNER/NAME[@REVISION][?config=NAME&split=SPLIT&files=GLOB] (quoted in a
    shell; its files are downloaded shard by shard as they are tokenized, see minigpt.data.hub). A mixture names
    its sources with weights: --data stories=train.txt:0.7 books=gutenberg/:0.3 (each source one path,
    folder or pattern; weight 1 if left out). Empty: TinyStories, downloaded from the hub."""
    val_paths: Annotated[tuple[str, ...], tyro.conf.arg(name="val-data", prefix_name=False)] = ()
    """Validation text (for a mixture, NAME=PATH per source); of an hf: dataset, its validation split unless
    ?split= says otherwise. Empty: hold out `val_fraction` of the training documents (or TinyStories' valid
    split); a mixture's sources without one hold out their own."""
    val_fraction: float = 0.05
    seq_len: int = 256
    """Training window length (tokens); at most model.max_seq_len. 0: the model's whole context (with
    --init-from, the default: the checkpoint's, halved until a step fits in memory)."""
    tokenizer: Literal["gpt2", "bpe", "hf"] = "gpt2"
    """gpt2: tiktoken's GPT-2 BPE (50257 tokens). bpe: a byte-level BPE trained on the training text. hf: the
    tokenizer of a transformers checkpoint (--data.hf-tokenizer), with its BOS and end-of-text conventions."""
    hf_tokenizer: str | None = None
    """With --data.tokenizer hf: a transformers checkpoint folder (its tokenizer.json, tokenizer_config.json
    and config.json), or the tokenizer/ folder of a run that trained with one."""
    bpe_vocab_size: int = 4096
    gpt2_dir: str | None = resume_safe(None)
    """Folder with GPT-2's vocab.bpe + encoder.json, for offline use (else $MINIGPT_GPT2_DIR, else download)."""
    cache_dir: str = resume_safe("")
    """Where token stores are kept (in its tokens/ folder). Empty: $MINIGPT_CACHE_DIR, else
    $XDG_CACHE_HOME/minigpt, else ~/.cache/minigpt, as for the compilation cache."""
    separator: Literal["eot", "blank-line"] = "eot"
    """How .txt files separate documents: <|endoftext|> markers (TinyStories), or blank lines (paragraphs)."""
    text_field: str = "text"
    """The .jsonl field, or .parquet column, that holds each document's text."""
    encoding_errors: Literal["error", "replace"] = "error"
    """Bytes that are not UTF-8: error (stop, naming the file and byte offset), or replace with U+FFFD and warn."""
    bpe_train_bytes: int = 50_000_000
    """The BPE is trained on the first this-many bytes of training documents, so huge corpora fit in memory."""
    tokenize_workers: int = resume_safe(0)
    """Processes that tokenize in parallel. 0: one per core for corpora over 64 MB (256 MB on 2 cores, where
    starting workers costs more below that), otherwise tokenize in this process."""

    window_start: Literal["anywhere", "document"] = "anywhere"
    """Where training windows begin. anywhere: the token stream is cut into consecutive windows, every token a
    target once per epoch. document: each window begins at a document (its end-of-text token), and documents
    longer than a window go on in further windows; the text after a short document is seen again as the
    start of the next one."""
    examples: tyro.conf.Suppress[bool] = False
    """Not a flag: set when a run's data holds examples (conversations), whose tokens carry the loss mask and
    where each example starts (`minigpt.data.packing`), for the train and eval steps to take apart."""

    def __post_init__(self) -> None:
        self.sources()  # the mixture syntax, checked before any data is read
        check(
            self.window_start in ("anywhere", "document"),
            f"data.window_start must be anywhere or document, got {self.window_start!r}",
        )
        check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        check(
            self.seq_len >= 0, f"data.seq_len must be positive (0: the model's context), got {self.seq_len}"
        )
        check(self.bpe_vocab_size >= 260, f"data.bpe_vocab_size must be >= 260, got {self.bpe_vocab_size}")
        check(self.bpe_train_bytes > 0, f"data.bpe_train_bytes must be positive, got {self.bpe_train_bytes}")
        check(self.tokenize_workers >= 0, f"data.tokenize_workers must be >= 0, got {self.tokenize_workers}")
        check(bool(self.text_field), "data.text_field must name a field")
        check(
            (self.tokenizer == "hf") == bool(self.hf_tokenizer),
            "--data.tokenizer hf and --data.hf-tokenizer FOLDER go together: name the checkpoint folder whose "
            "tokenizer to use",
        )

    def sources(self) -> tuple[Source, ...]:
        """The training sources: one unnamed source of every path, or the named sources of a mixture with
        their weights normalised to sum to 1."""
        named = _parse_named(self.paths, "--data", weighted=True)
        val = _parse_named(self.val_paths, "--val-data", weighted=False)
        if named is None:
            check(val is None, "--val-data names sources (NAME=PATH), but --data is not a mixture")
            return (Source("", self.paths, 1.0, self.val_paths),)
        check(
            val is not None or not self.val_paths, "a mixture's --val-data must name its sources: NAME=PATH"
        )
        unknown = sorted(set(val or {}) - set(named))
        check(not unknown, f"--val-data names {unknown[0] if unknown else ''!r}, which is no --data source")
        total = sum(w for _, w in named.values())
        check(math.isfinite(total), "--data: the mixture's weights sum past the largest float; use smaller")
        return tuple(
            Source(n, (p,), w / total, ((val[n][0],) if val and n in val else ()))
            for n, (p, w) in named.items()
        )

    def cache(self) -> Path:
        """The folder token stores are kept under (in its tokens/ folder)."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else user_cache_dir()

    def absolute(self) -> DataConfig:
        """The same data with every path absolute, so a run directory's config reads the same files (and token
        cache) from any working directory."""
        absolute = lambda p: str(Path(p).expanduser().absolute())
        return dataclasses.replace(
            self,
            paths=tuple(_absolute_item(p) for p in self.paths),
            val_paths=tuple(_absolute_item(p) for p in self.val_paths),
            cache_dir=str(self.cache().absolute()),
            gpt2_dir=None if self.gpt2_dir is None else absolute(self.gpt2_dir),
            hf_tokenizer=None if self.hf_tokenizer is None else absolute(self.hf_tokenizer),
        )
