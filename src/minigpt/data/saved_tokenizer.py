"""A tokenizer as saved in a folder, of any kind: a run's or token store's tokenizer/ (minigpt_tokenizer.json
says which kind), or a transformers checkpoint folder's own."""

from __future__ import annotations

import json
from pathlib import Path

from minigpt.config import ConfigError
from minigpt.data.pretrained_tokenizer import PretrainedTokenizer
from minigpt.data.tokenizer import BPETokenizer, GPT2Tokenizer, Tokenizer


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Load a tokenizer saved by `save` (in a run directory or token cache)."""
    directory = Path(directory)
    marker = directory / "minigpt_tokenizer.json"
    if not marker.is_file():
        raise ConfigError(f"no tokenizer saved in {directory}")
    try:
        kind = json.loads(marker.read_text())["kind"]
        if kind == "hf":
            return PretrainedTokenizer.load(directory)
        return GPT2Tokenizer(directory) if kind == "gpt2" else BPETokenizer.load(directory)
    except Exception as e:  # a truncated or edited file surfaces as many error types, from Rust too
        text = str(e).strip()
        why = text.splitlines()[0][:200] if text else type(e).__name__
        raise ConfigError(
            f"the tokenizer in {directory} is unreadable ({why}); copy it back from a copy of the run, or from "
            "the token store's tokenizer/ folder it was made with"
        ) from None


def open_pretrained(folder: str | Path) -> Tokenizer:
    """--data.hf-tokenizer's tokenizer: a run's tokenizer/ folder as saved, else a checkpoint folder's."""
    folder = Path(folder)
    if (folder / "minigpt_tokenizer.json").is_file():
        return load_tokenizer(folder)
    if not folder.is_dir():
        raise ConfigError(
            f"--data.hf-tokenizer {folder} is not a folder; name a transformers checkpoint folder"
        )
    return PretrainedTokenizer.from_checkpoint(folder)
