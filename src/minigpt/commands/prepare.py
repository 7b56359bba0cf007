"""`minigpt prepare`: tokenize a corpus into the token cache (`train` does this itself when needed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tyro

from minigpt.commands.flags import read_flags, split_preset
from minigpt.config import DataConfig, get_preset


@dataclasses.dataclass(frozen=True)
class PrepareArgs:
    """Tokenize a corpus into the token cache (`train` does this itself when needed)."""

    data: DataConfig


def parse(args: list[str]) -> PrepareArgs:
    preset, rest = read_flags(lambda: split_preset(args))
    default = PrepareArgs(data=get_preset(preset or "cpu").data)
    return read_flags(lambda: tyro.cli(PrepareArgs, default=default, args=rest, prog="minigpt prepare"))


def load() -> Callable[[PrepareArgs], None]:
    from minigpt.data.mixture import prepare_corpus
    from minigpt.data.progress import megabytes

    def run(parsed: PrepareArgs) -> None:
        for part in prepare_corpus(parsed.data).parts:
            store = part.store
            if part.name:
                print(f"source {part.name} (weight {part.weight:.3g}):")
            for split, info in store.meta["splits"].items():
                print(
                    f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens, {info['text_bytes']:,} bytes"
                )
            sources = store.meta["sources"]
            size = sum(f["size"] for files in sources.values() for f in files)
            print(
                f"sources: {len(sources['train'])} training and {len(sources['val'])} validation files, "
                f"{megabytes(size)}"
            )
            print(f"token store: {store.path} ({store.meta['tokenizer_identity']})")

    return run
