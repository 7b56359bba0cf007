"""SentencePiece-style tokenizer.json files (Llama 2's, Mistral's, Gemma's): what their pieces stand for, and
where their dummy prefix goes.

Such a tokenizer writes a space as "▁" inside its pieces and, with byte fallback, spells a byte it has no
piece for as a <0xNN> token. Most put a dummy "▁" before the text they encode (SentencePiece's
add_dummy_prefix): a byte that is not the text's. Some put it before every stretch between special tokens
(a Prepend normalizer, or a Metaspace pre-tokenizer whose prepend_scheme is "always"), others before the
start only ("first").

minigpt encodes a document with a twin of the tokenizer that adds no prefix, given " " + text: the same
tokens as the model was trained on, with the dummy always the first byte of the document's first token
(whatever the text starts with), and none before the later pieces of a document cut for length. Bits per
byte stay exact by not counting that byte: a piece starting with "▁" counts one byte fewer where it follows
a token that opens a document or segment (`PretrainedTokenizer.dummy_tables`).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

SPACE = "\u2581"
_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def is_spm(spec: dict[str, Any]) -> bool:
    """Whether tokenizer.json describes a SentencePiece-style BPE or Unigram (pieces spell spaces as ▁)."""
    steps = [spec.get("normalizer"), spec.get("pre_tokenizer"), spec.get("decoder")]
    return spec["model"]["type"] in ("BPE", "Unigram") and SPACE in json.dumps(steps, ensure_ascii=False)


def _steps(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The steps of a normalizer, pre-tokenizer or decoder (a Sequence's, or the one)."""
    if not node:
        return []
    return node.get(key, []) if node.get("type") == "Sequence" else [node]


def prefix_scheme(spec: dict[str, Any]) -> str:
    """Where the tokenizer puts its dummy "▁": "every" stretch between special tokens, the "first" only, or
    "none"."""
    if any(s.get("type") == "Prepend" for s in _steps(spec.get("normalizer"), "normalizers")):
        return "every"
    for step in _steps(spec.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") == "Metaspace":
            scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            return {"always": "every", "first": "first"}.get(scheme, "none")
    return "none"


def without_prefix(spec: dict[str, Any]) -> dict[str, Any]:
    """The same tokenizer with no dummy prefix, and a decoder that keeps a text's first space."""
    out = copy.deepcopy(spec)
    norm = out.get("normalizer")
    if norm and norm.get("type") == "Prepend":
        out["normalizer"] = None
    elif norm and norm.get("type") == "Sequence":
        norm["normalizers"] = [s for s in norm["normalizers"] if s.get("type") != "Prepend"]
    for node, key in ((out.get("pre_tokenizer"), "pretokenizers"), (out.get("decoder"), "decoders")):
        for step in _steps(node, key):
            if step.get("type") == "Metaspace":
                step.update(
                    {"prepend_scheme": "never"} if "prepend_scheme" in step else {"add_prefix_space": False}
                )
    dec = out.get("decoder")
    if dec and dec.get("type") == "Sequence":
        dec["decoders"] = [s for s in dec["decoders"] if s.get("type") != "Strip"]
    return out


def piece_bytes(piece: str, byte_fallback: bool) -> int:
    """UTF-8 bytes a piece stands for: one for a byte-fallback <0xNN>, else its text with ▁ as a space."""
    if byte_fallback and _BYTE.fullmatch(piece):
        return 1
    return len(piece.replace(SPACE, " ").encode())


def byte_fallback(spec: dict[str, Any]) -> bool:
    return bool(spec["model"].get("byte_fallback"))
