"""A trained run wherever it lives: a run directory (config.json, tokenizer/, checkpoints/) or a one-file
export. Reading its config, loading its model for inference, writing exports, and refusing a tokenizer that
is not the model's own.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from typing import Any

import jax

from minigpt.checkpoint import Checkpointer, export_config_and_tokenizer, read_export, write_export
from minigpt.config import ConfigError, TrainConfig, from_dict, load_json, to_dict
from minigpt.tokenizer import Tokenizer, load_tokenizer
from minigpt.trainer import Setup, build


def _not_a_run(path: Path) -> ConfigError:
    return ConfigError(
        f"{path} is neither a run directory (no config.json) nor an export; train with `minigpt train`"
    )


def run_config(path: str | Path) -> TrainConfig:
    """A run directory's (or export file's) config, read before any weights."""
    path = Path(path)
    if path.is_file():
        config, folder = export_config_and_tokenizer(path)
        shutil.rmtree(folder, ignore_errors=True)
        return from_dict(config)
    if (path / "config.json").is_file():
        return load_json(str(path / "config.json"))
    raise _not_a_run(path)


def inference_config(cfg: TrainConfig, n_devices: int) -> TrainConfig:
    """Inference uses every device for data parallelism; any batch that they divide will do."""
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, data=-1, fsdp=1, tensor=1),
        batch_size=math.lcm(cfg.batch_size, n_devices),
    )


def load_model(path: str | Path, devices: list | None = None) -> tuple[Setup, Any, Tokenizer, int]:
    """(setup, params, tokenizer, step) of a run directory (newest checkpoint) or of an export file."""
    path = Path(path)
    if path.is_file():
        config, tok_dir = export_config_and_tokenizer(path)
        cfg = from_dict(config)
    elif (path / "config.json").is_file():
        cfg, tok_dir = load_json(str(path / "config.json")), path / "tokenizer"
    else:
        raise _not_a_run(path)
    n_devices = len(devices if devices is not None else jax.devices())
    setup = build(inference_config(cfg, n_devices), devices)
    if path.is_file():
        params = read_export(path, setup.abstract_state.params)
        step = int(config.get("step", 0))
    else:
        ckpt = Checkpointer(path, keep=cfg.keep_checkpoints)
        state, _, _ = ckpt.restore(setup.abstract_state)
        ckpt.close()
        params, step = state.params, int(state.step)
    return setup, params, load_tokenizer(tok_dir), step


def export(run_dir: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the newest checkpoint's parameters, config and tokenizer to one file."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")
    setup, params, _, step = load_model(run_dir)
    write_export(out, params, {**to_dict(setup.cfg), "step": step}, Path(run_dir) / "tokenizer")
    return out


def check_tokenizer(saved_dir: Path, identity: str) -> None:
    """Refuse to train or evaluate a model with a tokenizer other than the one it was trained (or imported)
    with: the token ids would mean different text."""
    if not (saved_dir / "minigpt_tokenizer.json").is_file():
        return
    saved = load_tokenizer(saved_dir).identity
    if saved != identity:
        raise ConfigError(
            f"the model's tokenizer ({saved}, in {saved_dir}) differs from the one the data was tokenized with "
            f"({identity}); minigpt tokenizes corpora only with GPT-2's BPE or a BPE it trains itself"
        )
