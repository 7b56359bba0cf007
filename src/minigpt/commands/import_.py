"""`minigpt import`: a run directory from a local transformers checkpoint."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated

import tyro

from minigpt.commands.flags import read_flags
from minigpt.config import PRESETS, DataConfig


@dataclasses.dataclass(frozen=True)
class ImportArgs:
    """Make a run directory from a local Hugging Face transformers checkpoint (GPT2LMHeadModel,
    LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or ApertusForCausalLM; safetensors weights; GPT-2's
    tokenizer or the checkpoint's byte-level BPE tokenizer.json) that generate, eval and train --run-dir
    accept: a checkpoint at step 0 with a fresh optimizer state. A folder written by `minigpt export --format
    hf` gets its original run's config back; otherwise the finetune preset's, with the checkpoint's model and
    tokenizer and these --data flags (what eval reads and training continues on)."""

    hf: Annotated[str, tyro.conf.arg(help="transformers checkpoint folder (config.json, model.safetensors)")]
    out: Annotated[str, tyro.conf.arg(help="the run directory to write")]
    overwrite: bool = False
    data: DataConfig = PRESETS["finetune"].data


def parse(args: list[str]) -> ImportArgs:
    return read_flags(lambda: tyro.cli(ImportArgs, args=args, prog="minigpt import"))


def load() -> Callable[[ImportArgs], None]:
    from minigpt.data.pretrained_tokenizer import TEMPLATE_FILE
    from minigpt.hf import import_hf

    def run(a: ImportArgs) -> None:
        data = None if a.data == PRESETS["finetune"].data else a.data
        out, arch, command = import_hf(a.hf, a.out, overwrite=a.overwrite, data=data)
        print(f"imported a transformers {arch} from {a.hf} into {out} (step 0, fresh optimizer state)")
        print(f"continue training with: {command}")
        if (out / "tokenizer" / TEMPLATE_FILE).is_file():
            print(f"talk with it: minigpt chat --run {out}")

    return run
