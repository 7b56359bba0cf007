"""`minigpt export`: a run as one .npz file, as a transformers checkpoint folder, or its LoRA adapters."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Literal

import tyro

from minigpt.commands.flags import read_flags


@dataclasses.dataclass(frozen=True)
class ExportArgs:
    run: Annotated[str, tyro.conf.arg(help="run directory written by `minigpt train`")]
    out: Annotated[str, tyro.conf.arg(help="the file to write (.npz): parameters, config and tokenizer")]
    overwrite: bool = False
    format: Literal["minigpt", "hf"] = "minigpt"
    """minigpt: one .npz file; hf: a Hugging Face transformers checkpoint folder (config.json,
    model.safetensors, tokenizer) for AutoModelForCausalLM / AutoTokenizer.from_pretrained (LoRA adapters
    merged into the weights)."""
    adapters: bool = False
    """A LoRA run's adapters alone, as a PEFT adapter folder that peft loads onto the run's base checkpoint."""


def parse(args: list[str]) -> ExportArgs:
    return read_flags(lambda: tyro.cli(ExportArgs, args=args, prog="minigpt export"))


def load() -> Callable[[ExportArgs], None]:
    from minigpt.training.runs import export

    def run(a: ExportArgs) -> None:
        if a.adapters:
            from minigpt.hf.adapters import export_adapters

            print(
                f"exported the adapters of {a.run} to {export_adapters(a.run, a.out, a.overwrite)} for PEFT"
            )
            return
        if a.format == "hf":
            from minigpt.hf import export_hf

            folder, arch = export_hf(a.run, a.out, overwrite=a.overwrite)
            print(f"exported {a.run} to {folder} as a transformers {arch}")
            return
        out = export(a.run, a.out, overwrite=a.overwrite)
        print(f"exported {a.run} to {out} ({out.stat().st_size / 2**20:.1f} MiB)")

    return run
