"""A pretrained model's own tokenizer: the tokenizer.json a transformers checkpoint ships, with the conventions
the model was trained with, so minigpt can tokenize corpora (and later conversations) for it.

Those conventions live in three files of a checkpoint folder: the BOS a document starts with (tokenizer.json's
post-processor, or tokenizer_config.json's add_bos_token), the token a document ends with (tokenizer_config's
eos_token, else config.json's eos_token_id) and every token generation stops at (the eos ids of config.json
and generation_config.json: a chat model ends its turn with one of its own). minigpt keeps them in its
minigpt_tokenizer.json beside the tokenizer.json, whose bytes stay as the checkpoint had them.

Bits per byte stay exact because every token stands for fixed bytes (special tokens for none, and corpus
text never makes one: text that spells one is text, as with minigpt's own BPE): a byte-level BPE's tokens
their characters' bytes, a SentencePiece-style tokenizer's their pieces' (`metaspace`, which also says how
its dummy prefix is left out). Building a store checks that the bytes add up to the text's.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.config import ConfigError
from minigpt.data import metaspace
from minigpt.data.chat import CHATML, ChatTemplate
from minigpt.data.tokenizer import _byte_decoder, check_bytes
from minigpt.runtime import files

KIND = "hf"
TEMPLATE_FILE = "chat_template.jinja"


class PretrainedTokenizer:
    """A byte-level BPE from a transformers checkpoint, with its BOS (or none), end-of-text and stop ids."""

    def __init__(
        self,
        json_text: str,
        bos_id: int | None,
        eot_id: int,
        stop_ids: Iterable[int],
        chat_template: str | None = None,
        template_origin: str | None = None,
    ) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.json_text, self.chat_template_source = json_text, chat_template
        self.template_origin = template_origin  # the file it came from, for errors
        try:
            self.spec, self.tok = json.loads(json_text), HFTokenizer.from_str(json_text)
        except Exception as e:  # JSON's errors, and the Rust library's
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"the `tokenizers` library cannot read this tokenizer.json ({why})") from None
        self.byte_level = _is_byte_level(self.spec)
        if not (self.byte_level or metaspace.is_spm(self.spec)):
            raise ConfigError(
                "the tokenizer.json is neither a byte-level BPE (Llama 3, Qwen, SmolLM2 and GPT-2 ship one) nor "
                "a SentencePiece-style BPE or Unigram (Llama 2, Mistral, Gemma); minigpt cannot tokenize with it"
            )
        self.scheme = "none" if self.byte_level else metaspace.prefix_scheme(self.spec)
        # Documents are encoded by a twin that adds no dummy prefix, given it as a space (see metaspace).
        self.plain = (
            self.tok
            if self.scheme == "none"
            else HFTokenizer.from_str(json.dumps(metaspace.without_prefix(self.spec)))
        )
        self.dummy = "" if self.scheme == "none" else " "
        for t in (self.tok, self.plain):
            t.encode_special_tokens = True  # text that spells a special token is text
        self.bos_id, self.eot_id = bos_id, eot_id
        self.stop_ids = tuple(sorted({eot_id, *stop_ids}))
        self.vocab_size = self.tok.get_vocab_size()
        conventions = json.dumps(self._conventions(), sort_keys=True)
        self.vocab_hash = hashlib.sha256((json_text + conventions).encode()).hexdigest()
        self.identity = f"hf{self.vocab_size}-{self.vocab_hash[:16]}"
        for i in (self.eot_id, *self.stop_ids, *([] if self.bos_id is None else [self.bos_id])):
            if not 0 <= i < self.vocab_size:
                raise ConfigError(f"the tokenizer has no token {i}, which its model's config names")

    def _conventions(self) -> dict[str, Any]:
        return {"kind": KIND, "bos_id": self.bos_id, "eot_id": self.eot_id, "stop_ids": list(self.stop_ids)}

    def encode(self, text: str) -> list[int]:
        """A document's tokens, as its model was trained to read one (after the dummy prefix, if it has one)."""
        return self.encode_batch([text], num_threads=1)[0]

    def encode_batch(
        self, texts: list[str], num_threads: int | None = None, begins: Sequence[bool] | None = None
    ) -> list[list[int]]:
        """Encode many documents, or pieces of them: a piece that does not begin its document (`begins`), and
        an empty text, get no dummy prefix. The tokenizers library sizes its own threads; num_threads=1 keeps to this one."""
        if self.dummy:
            starts = [True] * len(texts) if begins is None else begins
            texts = [self.dummy + t if b and t else t for t, b in zip(texts, starts, strict=True)]
        if num_threads == 1:
            return [self.plain.encode(t, add_special_tokens=False).ids for t in texts]
        return [e.ids for e in self.plain.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The tokens' text; a document's dummy prefix shows as its first space."""
        return self.plain.decode(list(ids), skip_special_tokens=False)

    def encode_chat(self, text: str, offsets: bool = False) -> Any:
        """Encode text a chat template rendered: there, the special tokens it spells are special. With
        `offsets`, also each token's (start, end) characters in `text`."""
        encoding = _with_special_tokens(self.tok, text)  # as the model read its chats
        return (encoding.ids, encoding.offsets) if offsets else encoding.ids

    def chat_template(self) -> ChatTemplate:
        """The checkpoint's chat template (ChatML's where it has none), with its BOS and end-of-text names."""
        bos = None if self.bos_id is None else self.tok.id_to_token(self.bos_id)
        eos = self.tok.id_to_token(self.eot_id)
        if self.chat_template_source is None:
            return ChatTemplate(CHATML, bos, eos, "ChatML (the template of a model without one)")
        origin = f"the chat template in {self.template_origin or 'the tokenizer'}"
        return ChatTemplate(self.chat_template_source, bos, eos, origin)

    def token_bytes(self) -> np.ndarray:
        """Bytes each token stands for: special tokens none, other added tokens their text's, the rest their
        byte-level characters', or their piece's text (a dummy prefix counted: see `dummy_tables`)."""
        return self._table.copy()

    @functools.cached_property
    def _table(self) -> np.ndarray:
        """`token_bytes`, worked out once (a pass over the vocabulary)."""
        table, fallback = _byte_decoder(), metaspace.byte_fallback(self.spec)
        added = {t.content: t.special for t in self.tok.get_added_tokens_decoder().values()}
        out = np.zeros(self.vocab_size, np.int32)
        for token, i in self.tok.get_vocab(with_added_tokens=True).items():
            if token in added:
                out[i] = 0 if added[token] else len(token.encode())
            elif not self.byte_level:
                out[i] = metaspace.piece_bytes(token, fallback)
            elif all(ch in table for ch in token):
                out[i] = len(token)
            else:
                raise ConfigError(f"the tokenizer has a token that is not byte-level text: {token!r}")
        return out

    @functools.cache  # noqa: B019 (two entries per tokenizer, which lives as long as its run)
    def dummy_tables(self, examples: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """Where a dummy prefix is counted in `token_bytes` but is not text: (opens (V,) bool, dummy (V,)
        int32), the dummy a token holds when it follows an opener. A document opens after BOS or end-of-text;
        in a rendered example, after every special token where the tokenizer prefixes each stretch between
        them. None where the tokenizer adds none."""
        if self.scheme == "none" or (examples and self.scheme == "first"):
            return None
        vocab = self.tok.get_vocab(with_added_tokens=True)
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        opens = np.zeros(self.vocab_size, bool)
        dummy = np.zeros(self.vocab_size, np.int32)
        for token, i in vocab.items():
            opens[i] = token in special if examples else i in (self.eot_id, self.bos_id)
            dummy[i] = token.startswith(metaspace.SPACE) and token not in special
        return opens, dummy

    def text_bytes(self, ids: Sequence[int], opened: bool, examples: bool = False) -> np.ndarray:
        """The text bytes each of a stretch of tokens stands for (`opened`: its first token opens a document
        or example), its dummy prefix not counted."""
        ids = np.asarray(ids, np.int64)
        out = self._table[ids]
        tables = self.dummy_tables(examples)
        if tables is None or not len(ids):
            return out
        opens, dummy = tables
        return out - np.concatenate([[opened], opens[ids[:-1]]]) * dummy[ids]

    def check_rendered(self, text: str, ids: Sequence[int]) -> None:
        """`check_bytes` of text a chat template rendered, whose `encode_chat` is `ids`: the special tokens it
        spells stand for none of its bytes, the others for all the rest (counted without dummy prefixes)."""
        if self.scheme != "none":
            ids = _with_special_tokens(self.plain, text).ids
        ids = np.asarray(ids, np.int64)
        check_bytes(int(self._table[ids].sum()), len(text.encode()) - int(self._special_bytes[ids].sum()))

    @functools.cached_property
    def _special_bytes(self) -> np.ndarray:
        """The UTF-8 bytes of each special token's text (0 for every other token)."""
        out = np.zeros(self.vocab_size, np.int64)
        for i, t in self.tok.get_added_tokens_decoder().items():
            if t.special:
                out[i] = len(t.content.encode())
        return out

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files.write_text(directory / "tokenizer.json", self.json_text)
        files.write_json(directory / "minigpt_tokenizer.json", self._conventions())
        if self.chat_template_source is not None:
            files.write_text(directory / TEMPLATE_FILE, self.chat_template_source)

    @classmethod
    def load(cls, directory: str | Path) -> PretrainedTokenizer:
        """The tokenizer `save` wrote in `directory`."""
        directory = Path(directory)
        c = json.loads((directory / "minigpt_tokenizer.json").read_text())
        template = directory / TEMPLATE_FILE
        return cls(
            (directory / "tokenizer.json").read_text(),
            c["bos_id"],
            c["eot_id"],
            c["stop_ids"],
            template.read_text() if template.is_file() else None,
            str(template),
        )

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> PretrainedTokenizer:
        """A transformers checkpoint folder's tokenizer and conventions (see the module's docstring)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"{folder} has no tokenizer.json, the tokenizer minigpt reads from a checkpoint"
            )
        json_text = _read_text(path)
        settings = _read_json(folder / "tokenizer_config.json")
        eos_ids = _ids(_read_json(folder / "config.json").get("eos_token_id"))
        eos_ids += _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        try:
            probe = cls(json_text, None, 0, ())
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        eos_name = _token_name(settings.get("eos_token"))
        eot = probe.tok.token_to_id(eos_name) if eos_name else (eos_ids[0] if eos_ids else None)
        if eot is None:
            raise ConfigError(
                f"{folder} names no end-of-text token minigpt can find (tokenizer_config.json's eos_token, "
                "config.json's eos_token_id); add one there"
            )
        source, origin = _template(folder, settings)
        return cls(json_text, _bos_id(probe, settings), eot, eos_ids, source, origin)


def _with_special_tokens(tok: Any, text: str) -> Any:
    """`tok`'s encoding of `text` where the special tokens it spells are special (tokenizers.Encoding)."""
    tok.encode_special_tokens = False
    try:
        return tok.encode(text, add_special_tokens=False)
    finally:
        tok.encode_special_tokens = True


def _is_byte_level(spec: dict[str, Any]) -> bool:
    pre = spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return spec["model"]["type"] == "BPE" and any(p.get("type") == "ByteLevel" for p in pres)


def _read_text(path: Path) -> str:
    """A checkpoint file's text: one that is not UTF-8, or cannot be read, is named in one line."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (bad byte at offset {e.start}); fetch the checkpoint's file again"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path} could not be read ({e.strerror or type(e).__name__})") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(_read_text(path))
    except ValueError as e:
        raise ConfigError(f"{path} is not readable JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def _template(folder: Path, settings: dict) -> tuple[str | None, str | None]:
    """The folder's chat template and the file it is in: chat_template.jinja, else tokenizer_config.json's (a
    text, or a list of named templates, of which the one named "default")."""
    if (folder / TEMPLATE_FILE).is_file():
        return _read_text(folder / TEMPLATE_FILE), str(folder / TEMPLATE_FILE)
    value = settings.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    found = isinstance(value, str) and bool(value)
    return (value, str(folder / "tokenizer_config.json")) if found else (None, None)


def _ids(value: Any) -> list[int]:
    """An eos_token_id setting (an id, a list of ids, or none) as a list."""
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _token_name(value: Any) -> str | None:
    """tokenizer_config.json writes a token as its text or as {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _bos_id(tok: PretrainedTokenizer, settings: dict) -> int | None:
    """The token a document starts with: tokenizer_config.json's bos_token where add_bos_token says so,
    else what tokenizer.json's post-processor puts before a text (Llama 3's <|begin_of_text|>), else none."""
    add = settings.get("add_bos_token")
    name = _token_name(settings.get("bos_token"))
    if add is not None:
        return tok.tok.token_to_id(name) if add and name else None
    plain = tok.tok.encode("a", add_special_tokens=False).ids
    full = tok.tok.encode("a", add_special_tokens=True).ids
    prefix = full[: full.index(plain[0])] if plain and plain[0] in full else []
    return prefix[0] if len(prefix) == 1 else None
