"""A config as JSON and back: `to_dict`/`from_dict` for a run's config.json, `config_changes` for a resume.

`from_dict` coerces each JSON value to its field's type (lists to tuples, ints to floats, union members by
their "type" tag) and names the dotted key of any value that does not fit, so an edited or damaged
config.json fails in one line. Config files written by earlier versions load unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args

from minigpt.config.data import DataConfig
from minigpt.config.fields import is_resume_safe
from minigpt.config.lora import LoRAConfig
from minigpt.config.model import ModelConfig
from minigpt.config.run import DistributedConfig, MeshConfig, WandbConfig
from minigpt.config.training import TrainConfig
from minigpt.optim.optimizer import Optimizer, Schedule
from minigpt.runtime import files
from minigpt.runtime.errors import ConfigError


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-ready dict of a config, tagging union members (optimizer, schedule) with their class name."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = {"type": type(value).__name__, **to_dict(value)}
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


_UNION_MEMBERS = {
    cls.__name__: cls
    for cls in (
        *get_args(Optimizer),
        *get_args(Schedule),
        ModelConfig,
        LoRAConfig,
        DataConfig,
        MeshConfig,
        DistributedConfig,
        WandbConfig,
    )
}
"""The classes `to_dict` may tag a nested config with, by name."""


def subcommand_name(cls_or_instance: type | object) -> str:
    """tyro's subcommand name for a union member, without the field prefix: AdamW -> "adam-w",
    WSDSchedule -> "wsd-schedule" (so `optimizer:adam-w`, `schedule:wsd-schedule` on the command line).
    The same rule as tyro's camel-case to hyphen conversion of class names."""
    cls = cls_or_instance if isinstance(cls_or_instance, type) else type(cls_or_instance)
    return re.sub(r"((?<=[a-z0-9])[A-Z]|(?!^)[A-Z](?=[a-z]))", r"-\1", cls.__name__).lower()


def _shown(value: Any) -> Any:
    """A value as config.json holds it (tuples as lists), for messages."""
    return list(value) if isinstance(value, tuple) else value


def config_changes(old: TrainConfig, new: TrainConfig) -> list[str]:
    """Unsafe differences between a run's saved config and the one it is resumed with, as 'field: old -> new'
    (dotted for nested configs, e.g. 'model.d_ff: 64 -> 128'). Fields marked `resume_safe` are skipped, nested
    configs compared field by field; a different optimizer or schedule class is one difference,
    "optimizer.type: 'AdamW' -> 'SGD'"."""
    return [f"{name}: {a!r} -> {b!r}" for name, a, b in config_differences(old, new, resume_safe_too=False)]


def config_differences(a: Any, b: Any, resume_safe_too: bool = True) -> list[tuple[str, Any, Any]]:
    """Where two configs differ, field by field: (dotted name, a's value, b's value), values as config.json
    holds them; a different optimizer or schedule class is one difference, ('optimizer.type', 'AdamW', 'SGD')."""
    return _differences(a, b, "", resume_safe_too)


def _differences(old: Any, new: Any, prefix: str, resume_safe_too: bool) -> list[tuple[str, Any, Any]]:
    if type(old) is not type(new):
        return [(f"{prefix}type", type(old).__name__, type(new).__name__)]
    found: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(old):
        if is_resume_safe(f) and not resume_safe_too:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            found += _differences(a, b, f"{prefix}{f.name}.", resume_safe_too)
        elif a != b:
            found.append((f"{prefix}{f.name}", _shown(a), _shown(b)))
    return found


def from_dict(d: Any, cls: type = TrainConfig, prefix: str = "") -> Any:
    """Inverse of `to_dict`, for reading a run's config.json back. Keys it lacks keep their defaults; a key
    `cls` has no field for, a nested config without its "type" tag, or a value of the wrong type is a
    ConfigError naming the key (dotted: 'model.d_model'), as are the configs' own checks."""
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} is {_json_kind(d)}, not an object")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in d if k not in fields]
    if unknown:
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}' (from another minigpt version?)")
    if cls is ModelConfig and isinstance(d.get("remat"), bool):  # saved before remat policies existed
        d = {**d, "remat": "full" if d["remat"] else "none"}
    hints = typing.get_type_hints(cls)
    kwargs = {name: _field_value(value, hints[name], prefix + name) for name, value in d.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a check that met a value it did not expect
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'}: {e}") from None


def _json_kind(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
    kinds[dict] = "an object"
    return "null" if value is None else kinds.get(type(value), f"a {type(value).__name__}")


def _field_value(value: Any, hint: Any, key: str) -> Any:
    """`value` (as JSON holds it) for a field annotated `hint`, or a ConfigError saying what is wrong."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    options = get_args(hint) if union else (hint,)
    configs = [o for o in options if dataclasses.is_dataclass(o)]
    if configs:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} is {_json_kind(value)}, not a config object")
        if "type" not in value:
            names = " or ".join(json.dumps(c.__name__) for c in configs)
            raise ConfigError(f'{key} has no "type" tag ({names})')
        tag = value["type"]
        member = _UNION_MEMBERS.get(tag) if isinstance(tag, str) else None
        if member not in configs:
            names = ", ".join(c.__name__ for c in configs)
            raise ConfigError(f"{key}.type is {tag!r}, not one of {names}")
        return from_dict({k: v for k, v in value.items() if k != "type"}, member, f"{key}.")
    for option in options:
        ok, converted = _as_type(value, option)
        if ok:
            return converted
    raise ConfigError(f"{key} must be {_shown_type(hint)}, not {json.dumps(value)}")


def _as_type(value: Any, hint: Any) -> tuple[bool, Any]:
    """(whether `value` fits `hint`, the value as the field holds it); hints it does not know accept anything."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is str:
        return isinstance(value, str), value
    if origin is Literal:
        return value in get_args(hint) and isinstance(value, str | int), value
    if origin is tuple:
        (item, *_) = get_args(hint) or (Any,)
        if not isinstance(value, list | tuple):
            return False, value
        items = [_as_type(v, item) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    return True, value


def _shown_type(hint: Any) -> str:
    """A field's type as a message shows it: 'int', 'str | None', "one of 'pre', 'post'"."""
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {_shown_type(get_args(hint)[0])}"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def save_json(cfg: TrainConfig, path: str) -> None:
    files.write_json(path, to_dict(cfg))


def load_json(path: str) -> TrainConfig:
    """A run's config.json; a one-line ConfigError naming the file if it is not a readable minigpt config
    (torn or damaged JSON, wrong types, keys from another minigpt version, a failed check)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        why = f"invalid JSON: {e.msg.removesuffix(' at')} at line {e.lineno} column {e.colno}"
        if not raw.strip():
            why = "it is empty"
        elif not raw.rstrip().endswith(b"}"):  # save_json writes one object: a torn file ends mid-way
            why = f"it ends mid-way, at byte {len(raw):,}: truncated"
        raise _unreadable(path, why) from None
    except UnicodeDecodeError:
        raise _unreadable(path, "not UTF-8 text") from None
    try:
        return from_dict(d)
    except ConfigError as e:
        raise _unreadable(path, str(e)) from None


def _unreadable(path: str, why: str) -> ConfigError:
    return ConfigError(
        f"{path} is not a readable minigpt config ({why}); restore it from a copy, or delete it and resume "
        f"with `minigpt train --run-dir {Path(path).parent}` and the run's flags, which writes it again"
    )
