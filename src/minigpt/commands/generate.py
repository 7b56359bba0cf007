"""`minigpt generate`: sample text from a run, streamed for one prompt, batched for several."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import tyro

from minigpt.commands.flags import read_flags
from minigpt.config import ConfigError, SamplingConfig


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """Sample text from a trained run. Prompts must be shorter than the model's context (longer ones are
    refused); an empty prompt ("") starts a new document. A single prompt with one sample is streamed to the
    terminal as it is generated; several prompts (or samples) are decoded together in one batch."""

    run: Annotated[str, tyro.conf.arg(help="run directory written by `minigpt train`, or an export file")]
    prompt: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Text to continue; repeat the flag for several prompts. Default (no --prompt or --prompt-file):
    "Once upon a time"."""
    prompt_file: str | None = None
    """A file whose whole text is one more prompt (one trailing newline dropped; "-" reads stdin)."""
    sampling: Annotated[SamplingConfig, tyro.conf.arg(name="")] = SamplingConfig()
    stream: bool = True
    """Print a single prompt's single sample token by token as it is generated."""


def _prompts(a: GenerateArgs) -> list[str]:
    prompts = list(a.prompt)
    if a.prompt_file is not None:
        try:
            text = sys.stdin.read() if a.prompt_file == "-" else Path(a.prompt_file).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --prompt-file {a.prompt_file}: {e}") from None
        prompts.append(text.removesuffix("\n"))
    return prompts or ["Once upon a time"]


def parse(args: list[str]) -> tuple[GenerateArgs, list[str]]:
    """The flags, and the prompts (a --prompt-file read)."""
    a = read_flags(lambda: tyro.cli(GenerateArgs, args=args, prog="minigpt generate"))
    return a, _prompts(a)


def load() -> Callable[[tuple[GenerateArgs, list[str]]], None]:
    from minigpt.inference.generate import TextStreamer, generate_batch
    from minigpt.training.runs import load_model

    def run(parsed: tuple[GenerateArgs, list[str]]) -> None:
        a, prompts = parsed
        setup, params, tokenizer, _ = load_model(a.run)
        one = len(prompts) * a.sampling.num_samples == 1
        streamer = TextStreamer(tokenizer, prompts[0]) if a.stream and one else None
        texts = generate_batch(
            setup.graphdef,
            params,
            tokenizer,
            prompts,
            a.sampling,
            max_seq_len=setup.cfg.model.max_seq_len,
            on_token=streamer,
        )
        if streamer is not None:
            streamer.finish(texts[0][0])
            return
        for i, samples in enumerate(texts):
            for j, text in enumerate(samples):
                if len(texts) > 1:
                    print(f"--- prompt {i + 1}" + (f", sample {j + 1}" if len(samples) > 1 else ""))
                elif len(samples) > 1:
                    print(f"--- sample {j + 1}")
                print(text)

    return run
