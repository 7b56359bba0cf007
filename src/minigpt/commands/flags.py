"""The flag plumbing every command shares: `--preset` and `--compile-cache` taken out before tyro parses the
rest, optimizer and schedule flags accepted in any order, and every parsing mistake turned into one line.

Each command's module has `parse(args)`, which reads its flags with tyro and the configs alone, and `load()`,
which imports what the command runs (JAX among it) and returns its body, to call with what `parse` returned:
`cli.main` calls one, then the other, so a mistyped flag is reported before the seconds (on a busy machine,
minutes) that importing JAX takes."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import sys
from collections.abc import Callable
from typing import Any

import tyro

from minigpt.config import PRESETS, ConfigError, TrainConfig, get_preset, subcommand_name
from minigpt.runtime.console import first_message

TRAIN_FLAGS = (
    "The model comes from --preset NAME ({presets}; default cpu) and `minigpt train`'s flags, which all apply: "
    "--model.* (shape, --model.dtype, --model.remat, --model.attention), --data.seq-len, --optimizer.*, "
    "--schedule.*, --peak-tflops, ... (see `minigpt train --help`)."
)


def read_flags(fn: Callable[[], Any]) -> Any:
    """Parse flags with `fn`, turning every mistake into one line. Config construction validates each value
    and raises ConfigError (not a ValueError, so tyro lets it through to `main`). A value tyro itself cannot
    read (`--steps abc`, an unknown flag or choice) it reports in a box on stderr and exits 2: the box's
    first line becomes the error."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = fn()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except SystemExit as e:
        if e.code:
            raise ConfigError(first_message(stderr.getvalue())) from None
        sys.stderr.write(stderr.getvalue())
        raise
    sys.stderr.write(stderr.getvalue())  # warnings, if any
    return parsed


def split_preset(args: list[str]) -> tuple[str | None, list[str]]:
    """`--preset NAME`, and the other flags."""
    rest, preset = [], None
    it = iter(args)
    for a in it:
        if a == "--preset":
            preset = next(it, None)
            if preset is None:
                raise ConfigError(f"--preset needs a name: {', '.join(PRESETS)}")
        elif a.startswith("--preset="):
            preset = a.split("=", 1)[1]
        else:
            rest.append(a)
    return preset, rest


def split_compile_cache(args: list[str]) -> tuple[str | None, list[str]]:
    """`--compile-cache DIR|off`, which every command takes, and the command's own flags."""
    rest, setting = [], None
    it = iter(args)
    for a in it:
        if a == "--compile-cache" or a.startswith("--compile-cache="):
            setting = a.split("=", 1)[1] if "=" in a else next(it, "")
            if not setting or setting.startswith("--"):
                raise ConfigError("--compile-cache needs a folder, or off")
        else:
            rest.append(a)
    return setting, rest


def name_default_subcommands(args: list[str], default: TrainConfig) -> list[str]:
    """tyro takes `--optimizer.*` / `--schedule.*` flags only after their subcommand (`optimizer:adam-w`), and
    top-level flags only before any subcommand. Accept them in any order: group each flag (and its value)
    with its owner, name the preset's own optimizer/schedule when its fields are set without choosing one."""
    groups: dict[str, list[str]] = {"base": [], "optimizer": [], "schedule": []}
    owner = "base"
    for a in args:
        if a.startswith("--"):
            owner = next((f for f in ("optimizer", "schedule") if a.startswith(f"--{f}.")), "base")
        elif a.startswith(("optimizer:", "schedule:")):
            owner = a.split(":", 1)[0]
            groups[owner].insert(0, a)
            continue
        groups[owner].append(a)
    for field in ("optimizer", "schedule"):
        group = groups[field]
        if group and not group[0].startswith(f"{field}:"):
            group.insert(0, f"{field}:{subcommand_name(getattr(default, field))}")
    return groups["base"] + groups["optimizer"] + groups["schedule"]


def parse_train(args: list[str], prog: str, follow_context: bool = True) -> TrainConfig:
    """`minigpt train`'s flags as a TrainConfig: the preset's (finetune with --init-from, else cpu), then the
    rest; with --init-from and no --data.seq-len (and `follow_context`), windows of the source's context."""
    preset, rest = split_preset(args)
    given = {a.split("=", 1)[0].replace("_", "-") for a in rest if a.startswith("--")}
    starts_from = "--init-from" in given
    default = get_preset(preset or ("finetune" if starts_from else "cpu"))
    if follow_context and starts_from and "--data.seq-len" not in given:  # `app.initial.with_initial`
        default = dataclasses.replace(
            default, init_from="?", data=dataclasses.replace(default.data, seq_len=0)
        )
    rest = name_default_subcommands(rest, default)
    description = (
        f"Train a GPT. Presets (--preset NAME, default cpu; finetune with --init-from): {', '.join(PRESETS)}."
    )
    return tyro.cli(TrainConfig, default=default, args=rest, prog=prog, description=description)


def parse_with_train(cls: type, args: list[str], prog: str) -> tuple[Any, TrainConfig]:
    """`cls`'s own flags, and a TrainConfig from --preset and the rest (every `minigpt train` flag), so
    --help lists only what the command itself adds."""
    description = f"{inspect.cleandoc(cls.__doc__ or '')}\n\n{TRAIN_FLAGS.format(presets=', '.join(PRESETS))}"
    preset, rest = read_flags(lambda: split_preset(args))
    own, train_args = read_flags(
        lambda: tyro.cli(cls, args=rest, prog=prog, description=description, return_unknown_args=True)
    )
    train_args = [*train_args, *(["--preset", preset] if preset else [])]
    return own, read_flags(lambda: parse_train(train_args, prog, follow_context=False))  # no source is read
