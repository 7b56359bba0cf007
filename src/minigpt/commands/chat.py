"""`minigpt chat`: talk with a chat model, turn by turn, in the terminal."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Annotated

import tyro

from minigpt.commands.flags import read_flags
from minigpt.config import SamplingConfig


@dataclasses.dataclass(frozen=True)
class ChatArgs:
    """Talk with a chat model (a transformers chat checkpoint, imported or trained further): each line you
    type is a user turn, rendered with the model's chat template; the reply is streamed and ends at the
    model's end-of-turn token. The conversation stays in the model's key/value cache between turns. An empty
    line, "/exit", end of input (Ctrl-D) or Ctrl-C ends it."""

    run: Annotated[str, tyro.conf.arg(help="run directory, or an export file, of a chat model")]
    system: str = ""
    """A system message to start the conversation with."""
    sampling: Annotated[SamplingConfig, tyro.conf.arg(name="")] = SamplingConfig()


def parse(args: list[str]) -> ChatArgs:
    return read_flags(lambda: tyro.cli(ChatArgs, args=args, prog="minigpt chat"))


def load() -> Callable[[ChatArgs], None]:
    from minigpt.inference.conversation import Conversation
    from minigpt.training.runs import load_model

    def run(a: ChatArgs) -> None:
        setup, params, tokenizer, _ = load_model(a.run)
        chat = Conversation(setup, params, tokenizer, a.sampling, a.system)
        tty = sys.stdin.isatty()
        while True:
            try:
                line = input("you> " if tty else "")
            except EOFError:
                break
            if line.strip() in ("", "/exit"):
                break
            if (
                not tty
            ):  # turns read from a pipe: the output is a transcript, each turn marked as on a terminal
                print(f"you> {line}")
            print("model> ", end="", flush=True)
            chat.say(line, on_text=lambda piece: print(piece, end="", flush=True))
            print(flush=True)

    return run
