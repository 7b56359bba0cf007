"""The command line as a user meets it: train -> checkpoint -> generate/eval, and one-line errors."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from conftest import TINY_FLAGS, cli_error, run_cli, run_on_devices

from minigpt.cli import COMMANDS
from minigpt.config import get_preset, save_json
from minigpt.data.encode import usable_cores


def test_train_then_generate_and_eval_from_the_run_directory(small_corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cache = tmp_path / "cache"
    common = ["--data", str(small_corpus), "--data.cache-dir", str(cache), "--run-dir", str(run)]
    out = run_cli("train", *common, *TINY_FLAGS, "--steps", "6", "--eval-every", "3", "--log-every", "2",
                  "--ckpt-every", "3", "--sample-tokens", "5")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "val bits/byte" in out.stdout and "ETA" in out.stdout
    split = max(n for n in (1, 2, 4) if n <= usable_cores())  # one device per core that batch 4 divides over
    assert f"mesh {{'data': {split}, 'fsdp': 1, 'tensor': 1}}" in out.stdout
    assert ("the CPU split into" in out.stdout) == (split > 1)
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
    assert "unknown preset 'huge'; choose one of: cpu, tutorial, gpt2-124m" in cli_error(
        capsys, ["train", "--preset", "huge"]
    )


def test_missing_data_file(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    err = cli_error(
        capsys, ["train", "--data", str(tmp_path / "missing.txt"), "--data.cache-dir", str(tmp_path)]
    )
    assert "data path not found" in err


def test_empty_corpus(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    err = cli_error(
        capsys, ["train", "--data", str(tmp_path / "empty.txt"), "--data.cache-dir", str(tmp_path)]
    )
    assert "training corpus is empty" in err


def test_non_utf8_corpus(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("Once upon a time in Málaga".encode("latin-1"))
    err = cli_error(
        capsys, ["train", "--data", str(tmp_path / "latin1.txt"), "--data.cache-dir", str(tmp_path)]
    )
    assert "latin1.txt is not valid UTF-8 (bad byte at offset 21)" in err


def test_seq_len_above_the_model_maximum(capsys: pytest.CaptureFixture) -> None:
    err = cli_error(capsys, ["train", "--data.seq-len", "512", "--model.max-seq-len", "256"])
    assert "data.seq_len=512 exceeds model.max_seq_len=256" in err


def test_bad_values(capsys: pytest.CaptureFixture) -> None:
    assert "batch_size must be positive, got 0" in cli_error(capsys, ["train", "--batch-size", "0"])
    assert "model.d_model=100 must be divisible by model.n_heads=8" in cli_error(
        capsys, ["train", "--model.d-model", "100", "--model.n-heads", "8"]
    )


def test_generate_needs_a_run_directory(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert "is neither a run directory (no config.json) nor an export" in cli_error(
        capsys, ["generate", "--run", str(tmp_path)]
    )


CLI_ERRORS_WORKER = """
import os, sys, tempfile

log = tempfile.NamedTemporaryFile(suffix=".stderr", delete=False).name
os.dup2(os.open(log, os.O_WRONLY | os.O_APPEND), 2)  # all of stderr, Python's and C++'s, from the start
import json
from minigpt.cli import main

results, seen = [], 0
for argv in json.loads(ARGVS):
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    sys.stderr.flush()
    err = open(log).read()
    results.append([code, err[seen:]])  # this command's (the first's with anything printed at start-up)
    seen = len(err)
os.unlink(log)
print(json.dumps(results))
"""


def test_batch_not_divisible_by_data_parallel_size_and_bad_mesh(small_corpus: Path, tmp_path: Path) -> None:
    """Three `minigpt train` commands refused before any work, run one after another by the CLI's `main` in a
    single process with 8 devices (the device count is fixed when JAX starts; one process, not three)."""
    common = ["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path), *TINY_FLAGS]
    argvs = [
        [*common, "--batch-size", "12"],
        [*common, "--mesh.fsdp", "3"],  # data=-1 takes the rest: there is none
        [*common, "--mesh.data", "2", "--mesh.tensor", "2"],
    ]
    code = f"ARGVS = {json.dumps(json.dumps(argvs))}\n{CLI_ERRORS_WORKER}"
    (code1, err1), (code2, err2), (code3, err3) = run_on_devices(code, devices=8)
    assert code1 == 2
    assert err1.strip() == (
        "minigpt: error: batch_size=12 is not divisible by the data-parallel size 8 (mesh data x fsdp); "
        "use a multiple of 8"
    )
    assert code2 == 2 and "mesh sizes (-1, 3, 1) cannot fill 8 devices: 3 does not divide it" in err2
    assert code3 == 2 and "= 4 devices, but there are 8; sizes that work: 1x1x8" in err3


def test_values_tyro_cannot_read_are_one_line_too(capsys: pytest.CaptureFixture) -> None:
    """A flag value of the wrong type, an unknown choice or an unknown flag: tyro's multi-line box becomes one
    line naming the flag, and nothing else reaches the terminal."""
    assert "--steps: invalid literal for int() with base 10: 'abc'" in cli_error(
        capsys, ["train", "--steps", "abc"]
    )
    err = cli_error(capsys, ["train", "--model.norm", "foo"])
    assert "invalid choice 'foo' for argument '--model.norm'" in err and "'layernorm', 'rmsnorm'" in err
    assert "Unrecognized options: --bogus" in cli_error(capsys, ["train", "--bogus", "3"])
    assert "--top-k" in cli_error(capsys, ["generate", "--run", "r", "--top-k", "x"])


def test_eval_refuses_a_negative_batch_cap(capsys: pytest.CaptureFixture) -> None:
    err = cli_error(capsys, ["eval", "--run", "runs/cpu", "--batches", "-1"])
    assert err == "minigpt: error: --batches must be >= 0 (0: the whole validation split), got -1"


def test_a_damaged_config_json_is_one_line_naming_the_file(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """A run whose config.json was cut short (disk full, a kill mid-write by an older version) or written by
    another minigpt version: generate and eval name the file instead of a JSONDecodeError or TypeError."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / "config.json"
    save_json(get_preset("cpu"), str(path))
    text = path.read_text()
    fix = f"restore it from a copy, or delete it and resume with `minigpt train --run-dir {run}` and the run's flags"
    path.write_text(text[:100])
    assert cli_error(capsys, ["generate", "--run", str(run)]) == (
        f"minigpt: error: {path} is not a readable minigpt config (it ends mid-way, at byte 100: truncated); "
        f"{fix}, which writes it again"
    )
    path.write_text(text.replace('"seed": 0,', '"seed": 0, "zloss": 0.0001,'))
    assert cli_error(capsys, ["eval", "--run", str(run)]) == (
        f"minigpt: error: {path} is not a readable minigpt config (unknown key 'zloss' (from another minigpt "
        f"version?)); {fix}, which writes it again"
    )
    d = get_preset("cpu").model.d_model
    path.write_text(text.replace(f'"d_model": {d}', f'"d_model": "{d}"'))
    assert f'(model.d_model must be int, not "{d}"); {fix}' in cli_error(
        capsys, ["generate", "--run", str(run)]
    )


def test_os_errors_are_one_line_naming_the_file(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError no check anticipated (a path under a regular file, disk full, a read-only filesystem) ends
    in `minigpt: error: <what>: <file>`, exit 2, not a traceback."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a cat.\n<|endoftext|>\n")
    err = cli_error(capsys, ["prepare", "--data", str(corpus), "--data.cache-dir", str(corpus / "cache")])
    assert err.startswith(f"minigpt: error: Not a directory: {corpus}/cache"), err

    def disk_full(args: list[str]) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "runs/a/metrics.jsonl")

    def read_only(args: list[str]) -> None:
        raise OSError(
            errno.EROFS, os.strerror(errno.EROFS), "runs/a/.config.json.tmp", None, "runs/a/config.json"
        )

    monkeypatch.setitem(COMMANDS, "train", disk_full)
    assert cli_error(capsys, ["train"]) == "minigpt: error: No space left on device: runs/a/metrics.jsonl"
    monkeypatch.setitem(COMMANDS, "train", read_only)
    assert cli_error(capsys, ["train"]) == (
        "minigpt: error: Read-only file system: runs/a/.config.json.tmp -> runs/a/config.json"
    )


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_bench_and_profile_help_lists_their_own_flags_and_every_train_flag_applies(
    command: str, capsys: pytest.CaptureFixture
) -> None:
    from minigpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert (
        len(help_text.splitlines()) < 40
        and "--run-dir" not in help_text
        and "minigpt train --help" in help_text
    )
    assert "(default: )" not in help_text and ". (default: None)" not in help_text
    parse = {"bench": _parse_bench, "profile": _parse_profile}[command]
    own, cfg = parse(["--preset", "tutorial", "--model.n-layers", "2", "--optimizer.weight-decay", "0.1", "--batch-size",
                      "4", "--vocab-size", "512", "--mesh.fsdp", "2"])  # fmt: skip
    assert own.vocab_size == 512 and cfg.batch_size == 4 and cfg.mesh.fsdp == 2
    assert cfg.model.n_layers == 2 and cfg.optimizer.weight_decay == 0.1
    assert cfg.model.d_model == get_preset("tutorial").model.d_model
    assert "Unrecognized options: --bogus" in cli_error(capsys, [command, "--bogus", "1"])


def _parse_bench(args: list[str]):
    from minigpt.cli import BenchArgs, _parse_with_train

    return _parse_with_train(BenchArgs, args, "minigpt bench")


def _parse_profile(args: list[str]):
    from minigpt.cli import ProfileArgs, _parse_with_train

    return _parse_with_train(ProfileArgs, args, "minigpt profile")


def test_max_time_must_be_a_finite_number_of_seconds(capsys: pytest.CaptureFixture) -> None:
    """inf and nan are refused before anything starts (0 is the way to say "no budget")."""
    for value in ("inf", "nan", "-5"):
        err = cli_error(capsys, ["train", "--max-time", value])
        assert f"max_time must be a number of seconds >= 0 (0: no budget), got {float(value)}" in err, err
