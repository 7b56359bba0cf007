"""`minigpt train`: train a model, or resume the one in --run-dir."""

from __future__ import annotations

from minigpt.commands.flags import parse, parse_train, split_preset

ACCELERATOR_PRESET = "accelerator"
"""What `minigpt train` trains without --preset (or --init-from) where JAX finds a TPU or GPU."""


def main(args: list[str]) -> None:
    from minigpt.app.train import train

    cfg = parse(lambda: parse_train(args, "minigpt train"))
    preset, _ = split_preset(args)
    on_accelerator = None
    if preset is None and not cfg.init_from:
        on_accelerator = lambda: parse(
            lambda: parse_train(["--preset", ACCELERATOR_PRESET, *args], "minigpt train")
        )
    train(cfg, on_accelerator)
