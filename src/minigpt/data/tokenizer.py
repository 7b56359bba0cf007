"""Tokenizers: GPT-2 BPE through tiktoken (offline from local files too), or a byte-level BPE trained on the corpus.

Both expose the same small interface, including `token_bytes()`: how many UTF-8 bytes each token stands for,
which is what turns a loss into bits per byte so runs with different tokenizers compare.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from minigpt.config import ConfigError
from minigpt.data import hub
from minigpt.data.progress import megabytes
from minigpt.runtime import allocator, files, interrupts, watchdog

EOT = "<|endoftext|>"
GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
BPE_TRAIN_MAX_RUN = 256
"""BPE training sees runs of non-space (or of space) characters at most this long: the trainer's time grows
roughly quadratically with a pre-token's length (300 KB of letters without a space: 26 s at 4096 tokens;
300 KB of whitespace: 35 s at 300). Longer runs (base32, DNA, unspaced scripts, padding) are cut into
pieces for training only; words and encoding are untouched."""


class Tokenizer(Protocol):
    identity: str
    """Names the exact vocabulary: token caches and checkpoints made with another tokenizer are refused."""
    vocab_hash: str
    """sha256 (hex) of the full vocabulary and merges."""
    vocab_size: int
    eot_id: int
    """The token that ends a document (and, with none of its own, starts the next)."""
    bos_id: int | None
    """The token a document starts with, where the tokenizer's model was trained with one."""
    stop_ids: tuple[int, ...]
    """The tokens generation stops at: end-of-text, and a chat model's end-of-turn."""
    dummy: str
    """What the tokenizer puts before a document's text ("" but for SentencePiece's dummy prefix)."""

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(
        self, texts: list[str], num_threads: int | None = None, begins: Sequence[bool] | None = None
    ) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def token_bytes(self) -> np.ndarray: ...
    def save(self, directory: str | Path) -> None: ...


def check_bytes(counted: int, text: int, where: str = "") -> None:
    """Bits per byte count each token's bytes: refuse a tokenizer whose tokens do not add up to the text
    (`where`: what the text is, for the message)."""
    if counted != text:
        raise ConfigError(
            f"{where}{': ' * bool(where)}the tokenizer changes the text it encodes (a normalizer, or characters "
            f"it has no token for): its tokens stand for {counted:,} bytes of text that has {text:,}, so bits per "
            "byte cannot be counted; use a tokenizer that keeps every byte (byte-level BPE, or SentencePiece "
            "with byte fallback)"
        )


def check_document(
    tokenizer: Tokenizer, table: np.ndarray, text: str, ids: Sequence[int], where: str
) -> None:
    """`check_bytes` of a whole document's tokens (`table`: the tokenizer's `token_bytes()`; a dummy prefix
    is no text)."""
    counted = int(table[np.asarray(ids, np.int64)].sum()) - (len(tokenizer.dummy) if text else 0)
    check_bytes(counted, len(text.encode()), where)


def dummy_tables(tokenizer: Tokenizer, examples: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Where the tokenizer's token bytes count a dummy prefix that is no text (SentencePiece-style
    tokenizers: `PretrainedTokenizer.dummy_tables`); None for all others."""
    return tokenizer.dummy_tables(examples) if tokenizer.dummy else None  # type: ignore[attr-defined]


def document_start(tokenizer: Tokenizer) -> int:
    """The token a document is predicted from: its BOS, or the end-of-text that ended the one before."""
    return tokenizer.eot_id if tokenizer.bos_id is None else tokenizer.bos_id


@cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE writes each byte as one printable character."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class GPT2Tokenizer:
    """tiktoken's `gpt2` encoding, built from vocab.bpe + encoder.json so it also works offline."""

    vocab_size = 50257
    eot_id = 50256
    bos_id = None
    stop_ids = (eot_id,)
    dummy = ""

    def __init__(self, files_dir: str | Path) -> None:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str

        self.files_dir = Path(files_dir)
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(self.files_dir / "vocab.bpe"),
            encoder_json_file=str(self.files_dir / "encoder.json"),
            vocab_bpe_hash=GPT2_FILES["vocab.bpe"],
            encoder_json_hash=GPT2_FILES["encoder.json"],
        )
        self.enc = tiktoken.Encoding(
            name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={EOT: self.eot_id}
        )
        self.identity = "gpt2"
        # The files were checked against these hashes above, so they name the vocabulary.
        self.vocab_hash = hashlib.sha256("".join(GPT2_FILES.values()).encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(
        self, texts: list[str], num_threads: int | None = None, begins: Sequence[bool] | None = None
    ) -> list[list[int]]:
        """Encode many texts (a piece of a document encodes as it would at its start: `begins` is not
        needed); num_threads None: one thread per core, 1: in this thread."""
        threads = num_threads or os.cpu_count() or 1
        if threads == 1:
            return [self.enc.encode_ordinary(t) for t in texts]
        return self.enc.encode_ordinary_batch(texts, num_threads=threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(list(ids))

    def token_bytes(self) -> np.ndarray:
        out = np.array([len(self.enc.decode_single_token_bytes(i)) for i in range(self.vocab_size)], np.int32)
        out[self.eot_id] = 0
        return out

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in GPT2_FILES:
            if not (directory / name).exists():
                files.write_bytes(directory / name, (self.files_dir / name).read_bytes())
        files.write_json(directory / "minigpt_tokenizer.json", {"kind": "gpt2"})


class BPETokenizer:
    """A byte-level BPE (Hugging Face `tokenizers`) trained on the corpus: a vocabulary sized for the data."""

    EOT_ID = 0
    """A trained BPE's end-of-text id: its one special token, which comes first."""
    dummy = ""

    def __init__(self, tok) -> None:  # tok: tokenizers.Tokenizer
        self.tok = tok
        self.tok.encode_special_tokens = (
            True  # text spelling "<|endoftext|>" is text, as in tiktoken's encode_ordinary
        )
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)
        self.bos_id, self.stop_ids = None, (self.eot_id,)
        spec = tok.to_str()
        self.vocab_hash = hashlib.sha256(spec.encode()).hexdigest()
        self.identity = f"bpe{self.vocab_size}-{self.vocab_hash[:16]}"
        self.fast = _rank_twin(json.loads(spec), self.eot_id)
        """The same BPE as tiktoken runs it, several times faster, where it gives the same tokens (see
        `_rank_twin`); None where it might not."""

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        max_run: int | None = BPE_TRAIN_MAX_RUN,
        read_bytes: Callable[[], int] | None = None,
    ) -> BPETokenizer:
        """Train on `texts`, with progress on stdout (`read_bytes`: the bytes of the sources read so far, which
        progress counts; else the texts' own); runs of more than `max_run` non-space (or space) characters
        are cut into separate texts first (None: never), so no pre-token is longer. In a process whose malloc
        keeps one arena (`allocator`), the trainer's threads would queue on its lock: it trains in a fresh
        process, which counts the words as this one reads on."""
        from tokenizers import Tokenizer as HFTokenizer

        reading = _Reading(texts, read_bytes)
        pieces = iter(reading) if max_run is None else _capped_runs(reading, max_run)
        if allocator.one_arena():
            tok = HFTokenizer.from_str(_train_in_fresh_process(pieces, vocab_size))
        else:
            tok = _train(pieces, vocab_size)
        learned = tok.get_vocab_size()
        short = f" (of the {vocab_size} asked: the text holds no more pairs to merge)" * (
            learned < vocab_size
        )
        print(
            f"BPE: {learned} tokens learned from {reading.size()} of text in {reading.elapsed():.1f} s{short}"
        )
        return cls(tok)

    @classmethod
    def load(cls, directory: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(Path(directory) / "tokenizer.json")))

    def encode(self, text: str) -> list[int]:
        if self.fast is not None:
            return self.fast.encode_ordinary(text)
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(
        self, texts: list[str], num_threads: int | None = None, begins: Sequence[bool] | None = None
    ) -> list[list[int]]:
        """Encode many texts (`begins` is not needed: a piece encodes as it would at its start). None: a
        thread per core (HF tokenizers size their own pool: TOKENIZERS_PARALLELISM, RAYON_NUM_THREADS);
        num_threads=1 encodes in this thread."""
        if self.fast is not None:
            if num_threads == 1:
                return [self.fast.encode_ordinary(t) for t in texts]
            return self.fast.encode_ordinary_batch(texts, num_threads=num_threads or os.cpu_count() or 1)
        if num_threads == 1:
            return [self.tok.encode(t, add_special_tokens=False).ids for t in texts]
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        table = _byte_decoder()
        out = np.zeros(self.vocab_size, np.int32)
        for token, i in self.tok.get_vocab().items():
            out[i] = 0 if i == self.eot_id else len(token)
            assert i == self.eot_id or all(ch in table for ch in token), token
        return out

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files.write_text(directory / "tokenizer.json", self.tok.to_str(pretty=True))
        files.write_json(directory / "minigpt_tokenizer.json", {"kind": "bpe"})


def _rank_twin(spec: dict, eot_id: int):  # -> tiktoken.Encoding | None
    """A trained BPE's tokenizer.json as a tiktoken encoding: GPT-2's pre-tokenizing pattern, each token
    ranked by its id. tiktoken merges the adjacent pair whose result ranks lowest, HF's BPE the pair merged
    earliest, so the two agree where every merge makes a new token with the next id (the trainer's order);
    anything else (a merge that remakes an earlier token, another pre-tokenizer, a normalizer) gets None."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    plain = model.get("type") == "BPE" and not model.get("dropout") and not model.get("ignore_merges")
    if not (plain and spec.get("normalizer") is None and pre.get("type") == "ByteLevel"):
        return None
    if pre.get("add_prefix_space") or not pre.get("use_regex", True):
        return None
    vocab, table = model["vocab"], _byte_decoder()
    merged = [vocab.get("".join(m.split(" ", 1) if isinstance(m, str) else m)) for m in model["merges"]]
    singles = [i for t, i in vocab.items() if len(t) == 1]
    if None in merged or any(b != a + 1 for a, b in itertools.pairwise(merged)):
        return None
    if merged and (max(singles, default=-1) >= merged[0] or len(vocab) != len(singles) + len(merged) + 1):
        return None  # every token a byte, a merge or the end-of-text
    ranks = {bytes(table[c] for c in t): i for t, i in vocab.items() if i != eot_id}
    if len(ranks) != len(vocab) - 1 or len(singles) != 256:
        return None
    return tiktoken.Encoding(
        name="minigpt-bpe", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={EOT: eot_id}
    )


class _Reading:
    """The texts a BPE trains on, counted as they are read, with progress on stdout (stderr is for problems,
    which callers expect alone there): one line every
    PROGRESS_SECONDS (a line that updates in place on a terminal), then one when reading is done and the
    merges are being learned, whose length reading cannot tell."""

    PROGRESS_SECONDS = 15.0

    def __init__(self, texts: Iterable[str], read_bytes: Callable[[], int] | None = None) -> None:
        self.texts, self.nbytes, self.read_bytes = texts, 0, read_bytes
        self.started = self.shown = time.monotonic()
        self.tty = sys.stdout.isatty()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def size(self) -> str:
        return megabytes(self.read_bytes() if self.read_bytes else self.nbytes)

    def __iter__(self) -> Iterator[str]:
        for text in self.texts:
            self.nbytes += len(text.encode())
            if time.monotonic() - self.shown >= (0.5 if self.tty else self.PROGRESS_SECONDS):
                self.shown = time.monotonic()
                self._say(f"BPE: read {self.size()} of text in {self.elapsed():.0f} s", "\r")
            yield text
        self._say(
            f"BPE: read {self.size()} of text in {self.elapsed():.1f} s; learning the merges ...",
            "\n",
        )

    def _say(self, line: str, end: str) -> None:
        print(
            f"\r{line}\033[K" if self.tty else line,
            end=end if self.tty else "\n",
            file=sys.stdout,
            flush=True,
        )


def _capped_runs(texts: Iterable[str], max_run: int) -> Iterator[str]:
    """Each text, cut inside every run of more than max_run non-space (or space) characters, every max_run
    characters of the run; text without such runs passes whole."""
    long_run = re.compile(rf"(?<!\S)\S{{{max_run + 1},}}|(?<!\s)\s{{{max_run + 1},}}")
    for text in texts:
        start = 0
        for m in long_run.finditer(text):
            for cut in range(m.start() + max_run, m.end(), max_run):
                yield text[start:cut]
                start = cut
        yield text[start:]


def _train(texts: Iterable[str], vocab_size: int):  # -> tokenizers.Tokenizer
    """A byte-level BPE learned from `texts` in this process."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


PICKLE_CHARS = 1 << 20
"""Texts go to the fresh process of `_train_in_fresh_process` in pickles of about this many characters."""


def _train_in_fresh_process(texts: Iterable[str], vocab_size: int) -> str:
    """`_train` in a new Python process (its malloc as Python's own), the texts pickled to its stdin a batch
    at a time as they are read (the trainer counts words meanwhile): the trained tokenizer's JSON."""
    with tempfile.TemporaryDirectory(prefix="minigpt-bpe-") as tmp:
        out = Path(tmp) / "tokenizer.json"
        argv = [sys.executable, "-m", __name__, str(vocab_size), str(out)]
        with interrupts.sparing_children():
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE)  # no preexec_fn: that forks JAX's threads
        try:
            assert proc.stdin is not None
            with proc.stdin:
                batch: list[str] = []
                chars = 0
                for text in itertools.chain(texts, [None]):
                    if text is not None:
                        batch.append(text)
                        chars += len(text)
                    if batch and (text is None or chars >= PICKLE_CHARS):
                        pickle.dump(batch, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                        batch, chars = [], 0
            status = proc.wait()
        finally:
            proc.kill()
        if status != 0 or not out.is_file():
            raise RuntimeError(f"training the BPE in a fresh process failed (exit status {status})")
        return out.read_text()


def _train_child(argv: list[str]) -> None:
    """The fresh process of `_train_in_fresh_process`: VOCAB_SIZE OUT, batches of texts pickled on stdin."""
    watchdog.die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the parent stops it
    vocab_size, out = int(argv[0]), Path(argv[1])
    files.write_text(out, _train(_unpickled(sys.stdin.buffer), vocab_size).to_str())


def _unpickled(stream: Any) -> Iterator[str]:
    """The texts of the batches pickled one after another on `stream`, to its end."""
    while True:
        try:
            batch = pickle.load(stream)
        except EOFError:
            return
        yield from batch


def find_gpt2_files(gpt2_dir: str | None) -> Path:
    """A folder holding GPT-2's vocab.bpe + encoder.json: the given one, $MINIGPT_GPT2_DIR, or the hub's copy."""
    for candidate in (gpt2_dir, os.environ.get("MINIGPT_GPT2_DIR")):
        if candidate:
            path = Path(candidate).expanduser()
            missing = [n for n in GPT2_FILES if not (path / n).is_file()]
            if missing:
                raise ConfigError(f"GPT-2 tokenizer folder {path} lacks {', '.join(missing)}")
            return path
    why = hub.unreachable()  # then only the hub cache's copy, at once
    try:
        from huggingface_hub import hf_hub_download

        # The hub's gpt2 merges.txt / vocab.json are byte-identical to OpenAI's vocab.bpe / encoder.json.
        merges = hf_hub_download("openai-community/gpt2", "merges.txt", local_files_only=why is not None)
        vocab = hf_hub_download("openai-community/gpt2", "vocab.json", local_files_only=why is not None)
    except Exception as e:
        raise ConfigError(
            "could not download the GPT-2 tokenizer files; pass --data.gpt2-dir DIR (or set MINIGPT_GPT2_DIR) "
            f"to a folder with vocab.bpe and encoder.json ({why or type(e).__name__})"
        ) from None
    local = Path(os.path.expanduser("~/.cache/minigpt/gpt2"))
    local.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(merges, local / "vocab.bpe")
    shutil.copyfile(vocab, local / "encoder.json")
    return local


if __name__ == "__main__":
    _train_child(sys.argv[1:])
