"""`minigpt train`: train a model, or resume the one in --run-dir."""

from __future__ import annotations

from minigpt.commands.flags import parse, parse_train


def main(args: list[str]) -> None:
    from minigpt.app.train import train

    train(parse(lambda: parse_train(args, "minigpt train")))
