"""Configs: presets are valid, every config round-trips through JSON and through the CLI."""

from __future__ import annotations

import dataclasses

import pytest

from minigpt.cli import _parse_train
from minigpt.config import (
    PRESETS,
    ConfigError,
    MeshConfig,
    ModelConfig,
    TrainConfig,
    from_dict,
    get_preset,
    to_dict,
)
from minigpt.optimizer import Lion, WSDSchedule


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_json(name: str) -> None:
    cfg = PRESETS[name]
    assert from_dict(to_dict(cfg)) == cfg


def test_cli_flags_override_the_preset_and_round_trip() -> None:
    cfg = _parse_train(
        ["--preset", "tutorial", "--steps", "7", "--model.n-layers", "2", "optimizer:lion", "--optimizer.b1", "0.8",
         "schedule:wsd-schedule", "--schedule.total-steps", "7", "--schedule.warmup-steps", "1"],
        "minigpt train",
    )  # fmt: skip
    assert cfg.steps == 7 and cfg.model.n_layers == 2 and cfg.model.d_ff == 256  # the rest stays the preset's
    assert isinstance(cfg.optimizer, Lion) and cfg.optimizer.b1 == 0.8
    assert isinstance(cfg.schedule, WSDSchedule) and cfg.schedule.total_steps == 7
    assert from_dict(to_dict(cfg)) == cfg


def test_padded_vocab_is_a_multiple() -> None:
    assert ModelConfig(vocab_size=50257).padded_vocab == 50304
    assert ModelConfig(vocab_size=4096).padded_vocab == 4096


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelConfig(d_model=100, n_heads=8), "must be divisible by model.n_heads"),
        (lambda: ModelConfig(dropout=1.0), "model.dropout must be in"),
        (lambda: MeshConfig(data=-1, fsdp=-1), "at most one mesh size may be -1"),
        (lambda: TrainConfig(grad_accum=0), "grad_accum must be positive"),
        (lambda: dataclasses.replace(PRESETS["cpu"], data=dataclasses.replace(PRESETS["cpu"].data, seq_len=999)),
         "exceeds model.max_seq_len"),
        (lambda: get_preset("nope"), "unknown preset 'nope'"),
    ],
)  # fmt: skip
def test_bad_values_are_refused(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_optimizer_and_schedule_fields_need_no_subcommand_and_any_order() -> None:
    """`--schedule.total-steps 3000` sets the preset's own schedule; top-level flags may come after it."""
    cfg = _parse_train(
        ["--schedule.total-steps", "3000", "--optimizer.b1", "0.8", "--steps", "3000"], "minigpt train"
    )
    assert cfg.steps == 3000 and cfg.schedule.total_steps == 3000 and cfg.optimizer.b1 == 0.8
    assert type(cfg.schedule) is type(PRESETS["cpu"].schedule) and type(cfg.optimizer) is type(
        PRESETS["cpu"].optimizer
    )
    muon = _parse_train(
        ["--schedule.peak-lr", "0.02", "optimizer:muon", "--mesh.data", "-1"], "minigpt train"
    )
    assert type(muon.optimizer).__name__ == "Muon" and muon.schedule.peak_lr == 0.02
