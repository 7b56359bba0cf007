"""`minigpt plan`: the plan within 15% of XLA's figure for the compiled step, its one-line refusal of what does
not fit; `train` refuses such a step first, and with `--grad-accum auto` records the micro-batch as ints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import cli_error
from test_cli import TINY_FLAGS

from minigpt.config import TrainConfig, get_preset
from minigpt.tools import plan
from minigpt.training import devices, memory

CPU = get_preset("cpu")


def _cfg(batch: int = 16, seq: int = 128, vocab: int = 4096, **model) -> TrainConfig:
    m = dataclasses.replace(CPU.model, vocab_size=vocab, max_seq_len=max(seq, 128), **model)
    return dataclasses.replace(
        CPU, model=m, data=dataclasses.replace(CPU.data, seq_len=seq), batch_size=batch
    )


SMALL = {"d_model": 128, "n_layers": 2, "n_heads": 2, "d_ff": 512}
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64}  # test_cli's TINY_FLAGS


@pytest.mark.parametrize(
    "model", [SMALL, {**SMALL, "scan_layers": True, "remat": "full"}], ids=["unrolled", "scanned-remat-full"]
)
def test_plan_total_is_within_15_percent_of_xla(model: dict) -> None:
    cfg = _cfg(**model)
    planned, measured = memory.make_plan(cfg, "cpu", 1).total, plan.measure(cfg)
    assert abs(planned / measured - 1) < 0.15, (planned, measured)


def test_a_plan_that_does_not_fit_exits_1_with_one_line_naming_the_largest_term(
    capsys: pytest.CaptureFixture,
) -> None:
    from minigpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", "--device", "tpu-v5e", "--batch-size", "8192", "--no-measure"])
    assert exc.value.code == 1
    out, err = capsys.readouterr()
    assert "does NOT fit" in out and "| activations |" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("minigpt: error: does not fit: needs ") and "(tpu-v5e" in lines[0]
    assert "the largest term is activations" in lines[0] and "--grad-accum auto (micro-batch" in lines[0]


def test_plan_for_many_accelerators_and_a_bad_device(capsys: pytest.CaptureFixture) -> None:
    from minigpt.cli import main

    main(["plan", "--preset", "gpt2-124m", "--device", "h100", "--devices", "8", "--no-measure"])
    out = capsys.readouterr().out
    assert "8 x h100 (mesh data 8 x fsdp 1 x tensor 1)" in out and "fits:" in out
    err = cli_error(capsys, ["plan", "--device", "b200"])
    assert "unknown device kind 'b200'; choose one of: cpu, h100, h200, a100-40gb" in err
    err = cli_error(capsys, ["plan", "--devices", "3", "--mesh.data", "2", "--no-measure"])
    assert "mesh data x fsdp x tensor = 2x1x1 = 2 devices, but there are 3" in err


@pytest.mark.slow
def test_train_with_grad_accum_auto_picks_a_micro_batch_and_records_ints(
    small_corpus: Path, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture
) -> None:
    """A 64-sequence batch that does not fit a (pretend) 3 MiB host trains as 4 micro-batches of 16."""
    from minigpt.cli import main

    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 3 * 2**20)
    run = tmp_path / "run"
    flags = [*TINY_FLAGS, "--batch-size", "64", "--grad-accum", "auto", "--steps", "2", "--eval-every", "2"]
    main(["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"),
          "--run-dir", str(run), *flags, "--sample-tokens", "2", "--eval-batches", "1"])  # fmt: skip
    out = capsys.readouterr().out
    saved = json.loads((run / "config.json").read_text())
    assert saved["grad_accum"] > 1 and saved["batch_size"] * saved["grad_accum"] == 64
    assert f"grad_accum auto: micro-batch {saved['batch_size']} x {saved['grad_accum']} = 64 sequences" in out
    assert "done: step 2" in out


def test_train_refuses_a_step_that_cannot_fit_before_anything_else(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """A batch no machine holds (2^20 sequences: terabytes) is refused by `train` in one line with the plan's
    figure and the flag that fits, before any text is read or program compiled (it once ended after 107 s
    in an allocation error); nothing is left in the run directory."""
    missing = tmp_path / "not-read.txt"
    err = cli_error(capsys, ["train", "--batch-size", str(2**20), "--data", str(missing), "--run-dir", "run"])
    assert (
        err.startswith("minigpt: error: the train step does not fit: needs ") and "--grad-accum auto" in err
    )
    assert not (tmp_path / "run").exists()
