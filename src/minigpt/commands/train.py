"""`minigpt train`: train a model, or resume the one in --run-dir."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minigpt.commands.flags import parse_train, read_flags
from minigpt.config import TrainConfig


def parse(args: list[str]) -> TrainConfig:
    return read_flags(lambda: parse_train(args, "minigpt train"))


def load() -> Callable[[TrainConfig], Any]:
    from minigpt.app.train import train

    return train
