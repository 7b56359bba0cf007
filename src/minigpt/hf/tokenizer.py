"""Tokenizer conversion between minigpt and transformers.

GPT-2's BPE becomes vocab.json + merges.txt (GPT2Tokenizer); a trained byte-level BPE its tokenizer.json
(PreTrainedTokenizerFast). Both set `split_special_tokens: true`, so, as in minigpt, text that spells
"<|endoftext|>" is encoded as plain text (minigpt splits documents at end-of-text and never makes the token
from text); load with `AutoTokenizer.from_pretrained(DIR, split_special_tokens=False)` for transformers'
usual behaviour. End-of-text is the bos/eos (and generation pad) token, as in GPT-2: prompt with it to start
a new document. Reading goes the other way, for those two kinds only.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

from minigpt.config import ConfigError
from minigpt.data.pretrained_tokenizer import PretrainedTokenizer
from minigpt.data.tokenizer import EOT, GPT2_FILES, BPETokenizer, GPT2Tokenizer, Tokenizer


def write_hf_tokenizer(tokenizer: Any, out: Path, max_seq_len: int) -> None:
    """Tokenizer files that AutoTokenizer loads to encode exactly as minigpt does."""
    settings = {
        "bos_token": EOT,
        "eos_token": EOT,
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,  # "<|endoftext|>" in text is text, as in minigpt
    }
    if isinstance(tokenizer, GPT2Tokenizer):
        shutil.copyfile(tokenizer.files_dir / "encoder.json", out / "vocab.json")
        shutil.copyfile(tokenizer.files_dir / "vocab.bpe", out / "merges.txt")
        settings = {
            "tokenizer_class": "GPT2Tokenizer",
            **settings,
            "unk_token": EOT,
            "add_prefix_space": False,
            "add_bos_token": False,
            "errors": "replace",
        }
    elif isinstance(tokenizer, BPETokenizer):
        (out / "tokenizer.json").write_text(tokenizer.tok.to_str())
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", **settings}
    elif isinstance(tokenizer, PretrainedTokenizer):  # the checkpoint's own, with its conventions
        (out / "tokenizer.json").write_text(tokenizer.json_text)
        name = tokenizer.tok.id_to_token
        settings = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None if tokenizer.bos_id is None else name(tokenizer.bos_id),
            "eos_token": name(tokenizer.eot_id),
            "model_max_length": max_seq_len,
            "clean_up_tokenization_spaces": False,
        }
        if tokenizer.chat_template_source is not None:
            (out / "chat_template.jinja").write_text(tokenizer.chat_template_source)
    else:
        raise ConfigError(f"cannot export a {type(tokenizer).__name__} tokenizer to transformers")
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def is_gpt2_folder(hf_dir: Path) -> bool:
    """Whether a transformers folder's tokenizer is GPT-2's: vocab.json + merges.txt byte-identical to it."""
    import hashlib

    def sha(name: str) -> str | None:
        p = hf_dir / name
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None

    return sha("vocab.json") == GPT2_FILES["encoder.json"] and sha("merges.txt") == GPT2_FILES["vocab.bpe"]


def read_hf_tokenizer(hf_dir: Path, bpe_identity: str | None = None) -> Tokenizer:
    """minigpt's tokenizer for a transformers folder: GPT-2's BPE (vocab.json + merges.txt, byte-identical
    to GPT-2's files); the BPE minigpt trained, where the folder is minigpt's export of a run whose tokenizer
    was `bpe_identity`; else the checkpoint's own byte-level BPE with its conventions."""
    if is_gpt2_folder(hf_dir):
        return _gpt2_from(hf_dir / "vocab.json", hf_dir / "merges.txt")
    if not (hf_dir / "tokenizer.json").is_file():
        raise ConfigError(
            f"{hf_dir} has no tokenizer minigpt can use: GPT-2's vocab.json + merges.txt, or a byte-level "
            "BPE tokenizer.json"
        )
    if bpe_identity is not None:
        from tokenizers import Tokenizer as HFTokenizer

        with contextlib.suppress(Exception):  # anything else is read (and its errors said) below
            bpe = BPETokenizer(HFTokenizer.from_file(str(hf_dir / "tokenizer.json")))
            if bpe.identity == bpe_identity:
                return bpe
    return PretrainedTokenizer.from_checkpoint(hf_dir)


def _gpt2_from(vocab_json: Path, merges_txt: Path) -> GPT2Tokenizer:
    """GPT2Tokenizer from transformers' vocab.json + merges.txt (GPT-2's encoder.json + vocab.bpe), staged
    in a temporary folder under minigpt's names (the caller removes `files_dir` once saved)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="minigpt-gpt2-"))
    shutil.copyfile(vocab_json, folder / "encoder.json")
    shutil.copyfile(merges_txt, folder / "vocab.bpe")
    return GPT2Tokenizer(folder)
