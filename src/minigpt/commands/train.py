"""`minigpt train`: train a model, or resume the one in --run-dir."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from minigpt.commands.flags import parse_train, read_flags, split_preset
from minigpt.config import TrainConfig

ACCELERATOR_PRESET = "accelerator"
"""What `minigpt train` trains without --preset (or --init-from) where JAX finds a TPU or GPU."""


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """The run's config, and without a preset the flags again, to read over the accelerator preset where the
    run finds one (known only once JAX has started)."""

    cfg: TrainConfig
    args: tuple[str, ...] | None = None

    def on_accelerator(self) -> TrainConfig:
        args = ["--preset", ACCELERATOR_PRESET, *(self.args or ())]
        return read_flags(lambda: parse_train(args, "minigpt train"))


def parse(args: list[str]) -> TrainArgs:
    cfg = read_flags(lambda: parse_train(args, "minigpt train"))
    preset, _ = split_preset(args)
    return TrainArgs(cfg, tuple(args) if preset is None and not cfg.init_from else None)


def load() -> Callable[[TrainArgs], Any]:
    from minigpt.app.train import train

    return lambda parsed: train(parsed.cfg, parsed.on_accelerator if parsed.args is not None else None)
