"""The command line as a user meets it: train -> checkpoint -> generate/eval, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from minigpt.cli import main

TINY_FLAGS = [
    "--model.d-model", "32", "--model.n-heads", "4", "--model.n-layers", "1", "--model.d-ff", "64",
    "--model.max-seq-len", "32", "--data.seq-len", "16", "--data.bpe-vocab-size", "300", "--batch-size", "4",
]  # fmt: skip


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minigpt: error: ") and "\n" not in err, err
    assert "Traceback" not in err
    return err


def test_train_then_generate_and_eval_from_the_run_directory(small_corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cache = tmp_path / "cache"
    common = ["--data", str(small_corpus), "--data.cache-dir", str(cache), "--run-dir", str(run)]
    out = run_cli("train", *common, *TINY_FLAGS, "--steps", "6", "--eval-every", "3", "--log-every", "2",
                  "--ckpt-every", "3", "--sample-tokens", "5")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "val bits/byte" in out.stdout and "ETA" in out.stdout
    for name in ("config.json", "metrics.jsonl", "loss.png", "samples.txt", "tokenizer/tokenizer.json"):
        assert (run / name).is_file(), name
    assert any((run / "tb").iterdir())
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]

    gen = [
        "generate",
        "--run",
        str(run),
        "--prompt",
        "Tom saw",
        "--max-new-tokens",
        "12",
        "--temperature",
        "1.0",
    ]
    first, again, other = (
        run_cli(*gen, "--seed", "1"),
        run_cli(*gen, "--seed", "1"),
        run_cli(*gen, "--seed", "2"),
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("Tom saw") and first.stdout == again.stdout
    assert other.stdout != first.stdout

    ev = run_cli("eval", "--run", str(run))
    assert ev.returncode == 0, ev.stderr
    assert "step 6 | val loss" in ev.stdout and "bits/byte" in ev.stdout


def test_unknown_preset(capsys: pytest.CaptureFixture) -> None:
    assert "unknown preset 'huge'; choose one of: cpu, tutorial, gpt2-124m" in _error(
        capsys, ["train", "--preset", "huge"]
    )


def test_missing_data_file(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    err = _error(
        capsys, ["train", "--data", str(tmp_path / "missing.txt"), "--data.cache-dir", str(tmp_path)]
    )
    assert "data path not found" in err


def test_empty_corpus(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    err = _error(capsys, ["train", "--data", str(tmp_path / "empty.txt"), "--data.cache-dir", str(tmp_path)])
    assert "training corpus is empty" in err


def test_non_utf8_corpus(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("Once upon a time in Málaga".encode("latin-1"))
    err = _error(capsys, ["train", "--data", str(tmp_path / "latin1.txt"), "--data.cache-dir", str(tmp_path)])
    assert "latin1.txt is not valid UTF-8 (bad byte at offset 21)" in err


def test_seq_len_above_the_model_maximum(capsys: pytest.CaptureFixture) -> None:
    err = _error(capsys, ["train", "--data.seq-len", "512", "--model.max-seq-len", "256"])
    assert "data.seq_len=512 exceeds model.max_seq_len=256" in err


def test_bad_values(capsys: pytest.CaptureFixture) -> None:
    assert "batch_size must be positive, got 0" in _error(capsys, ["train", "--batch-size", "0"])
    assert "model.d_model=100 must be divisible by model.n_heads=8" in _error(
        capsys, ["train", "--model.d-model", "100", "--model.n-heads", "8"]
    )


def test_generate_needs_a_run_directory(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert "is neither a run directory (no config.json) nor an export" in _error(
        capsys, ["generate", "--run", str(tmp_path)]
    )


def test_batch_not_divisible_by_data_parallel_size_and_bad_mesh(small_corpus: Path, tmp_path: Path) -> None:
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    common = ["--data", str(small_corpus), "--data.cache-dir", str(tmp_path), *TINY_FLAGS]
    out = run_cli("train", *common, "--batch-size", "12", env=env)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "minigpt: error: batch_size=12 is not divisible by the data-parallel size 8 (mesh data x fsdp); "
        "use a multiple of 8"
    )
    out = run_cli("train", *common, "--mesh.fsdp", "3", env=env)  # data=-1 takes the rest: there is none
    assert (
        out.returncode == 2
        and "mesh sizes (-1, 3, 1) cannot fill 8 devices: 3 does not divide it" in out.stderr
    )
    out = run_cli("train", *common, "--mesh.data", "2", "--mesh.tensor", "2", env=env)
    assert out.returncode == 2 and "= 4 devices, but there are 8; sizes that work: 1x1x8" in out.stderr


def test_values_tyro_cannot_read_are_one_line_too(capsys: pytest.CaptureFixture) -> None:
    """A flag value of the wrong type, an unknown choice or an unknown flag: tyro's multi-line box becomes one
    line naming the flag, and nothing else reaches the terminal."""
    assert "--steps: invalid literal for int() with base 10: 'abc'" in _error(
        capsys, ["train", "--steps", "abc"]
    )
    err = _error(capsys, ["train", "--model.norm", "foo"])
    assert "invalid choice 'foo' for argument '--model.norm'" in err and "'layernorm', 'rmsnorm'" in err
    assert "Unrecognized options: --bogus" in _error(capsys, ["train", "--bogus", "3"])
    assert "--top-k" in _error(capsys, ["generate", "--run", "r", "--top-k", "x"])
