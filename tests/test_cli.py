"""The command line as a user meets it: train -> checkpoint -> generate/eval, and one-line errors."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TINY_FLAGS, WORKDIR, cli_env, cli_error, run_cli, run_on_devices

from minigpt.cli import COMMANDS
from minigpt.config import DataConfig, get_preset, save_json
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
    assert f"mesh {{'data': 1, 'fsdp': {split}, 'tensor': 1}}" in out.stdout  # a split CPU trains FSDP
    assert ("the CPU split into" in out.stdout) == ("FSDP over them" in out.stdout) == (split > 1)
    if split > 1:  # the first line says what the mesh line shows, and how to have the other layout
        assert f"FSDP over them (--mesh.data {split} trains data parallel instead)" in out.stdout
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
    assert (
        "unknown preset 'huge'; choose one of: cpu, finetune, tutorial, accelerator, gpt2-124m"
        in cli_error(capsys, ["train", "--preset", "huge"])
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
    assert "; did you mean --max-time? (see --help)" in cli_error(capsys, ["train", "--max-tme", "5"])
    assert "--top-k" in cli_error(capsys, ["generate", "--run", "r", "--top-k", "x"])


FLAGS_BEFORE_JAX = """
import json, sys
from minigpt.cli import main

errors = []
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit as e:
        errors.append(e.code)
print(json.dumps({"codes": errors, "jax": sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))}))
"""


def test_every_command_reports_a_bad_flag_before_importing_jax() -> None:
    """Importing JAX takes seconds, minutes on a busy machine: a mistyped flag or an impossible value is
    reported before it, by every command (lm-eval's own flags are lm-eval's)."""
    argvs = [["train", "--stepz", "3"], ["train", "--batch-size", "0"], ["train", "optimizer:adam-w", "--optimizer.b1", "2"],
             ["eval", "--run", "r", "--bogus"], ["generate", "--run", "r", "--temperature", "-1"],
             ["chat", "--run", "r", "--top-p", "0"], ["prepare", "--bogus"], ["export", "--run", "r"],
             ["import", "--hf", "h"], ["check"], ["bench", "--batch-sizes", "x"], ["profile", "--trace-stepz", "2"],
             ["plan", "--devicez", "8"], ["serve", "--run", "r", "--engine.slots", "0"]]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", FLAGS_BEFORE_JAX, json.dumps(argvs)], capture_output=True,
                         text=True, env=cli_env(), cwd=WORKDIR, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result == {"codes": [2] * len(argvs), "jax": []}
    errors = out.stderr.strip().splitlines()
    assert len(errors) == len(argvs) and all(e.startswith("minigpt: error: ") for e in errors), errors
    assert "did you mean --steps?" in errors[0] and "batch_size must be positive" in errors[1]


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

    monkeypatch.setitem(COMMANDS, "train", SimpleNamespace(parse=lambda args: args, load=lambda: disk_full))
    assert cli_error(capsys, ["train"]) == "minigpt: error: No space left on device: runs/a/metrics.jsonl"
    monkeypatch.setitem(COMMANDS, "train", SimpleNamespace(parse=lambda args: args, load=lambda: read_only))
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
    from minigpt.commands.bench import BenchArgs
    from minigpt.commands.flags import parse_with_train

    return parse_with_train(BenchArgs, args, "minigpt bench")


def _parse_profile(args: list[str]):
    from minigpt.commands.flags import parse_with_train
    from minigpt.commands.profile import ProfileArgs

    return parse_with_train(ProfileArgs, args, "minigpt profile")


def test_max_time_must_be_a_finite_number_of_seconds(capsys: pytest.CaptureFixture) -> None:
    """inf and nan are refused before anything starts (0 is the way to say "no budget")."""
    for value in ("inf", "nan", "-5"):
        err = cli_error(capsys, ["train", "--max-time", value])
        assert f"max_time must be a number of seconds >= 0 (0: no budget), got {float(value)}" in err, err


def _interrupt(cmd: list[str], ready: Callable[[subprocess.Popen], bool]) -> tuple[int, str]:
    """Start `cmd` in a session of its own, wait until `ready(process)`, then press Ctrl-C as a terminal does
    (SIGINT to the whole process group: worker processes too): (exit status, stderr)."""
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(), cwd=WORKDIR,
                             start_new_session=True)  # fmt: skip
    try:
        while not ready(child):
            assert child.poll() is None, child.communicate()[1].decode()[-3000:]
            time.sleep(0.02)
        os.killpg(child.pid, signal.SIGINT)
        err = child.communicate(timeout=300)[1].decode()
        return child.returncode, err
    finally:
        if child.poll() is None:
            child.kill()


def _stopped_in_one_line(code: int, err: str) -> None:
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "minigpt: interrupted"


@pytest.mark.slow
def test_ctrl_c_stops_generate_while_it_streams(small_corpus: Path, tmp_path: Path) -> None:
    """Pressed once the first tokens are printed (the model's context is long, so decoding would go on):
    exit 130 and one line. Before, a Ctrl-C landing in XLA's callbacks or exit handlers printed a traceback,
    or the command ran on to the end."""
    run = tmp_path / "run"
    flags = [*TINY_FLAGS, "--model.max-seq-len", "2048", "--steps", "1", "--sample-tokens", "4"]
    out = run_cli("train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path), "--run-dir", str(run), *flags)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    cmd = [sys.executable, "-m", "minigpt.cli", "generate", "--run", str(run), "--prompt", "The", "--temperature",
           "0", "--max-new-tokens", "2000"]  # fmt: skip
    _stopped_in_one_line(*_interrupt(cmd, lambda child: bool(child.stdout.read(3))))


PREPARE = """
import gc, signal, sys, time
import minigpt.data.build as build
import minigpt.data.encode as encode

build.JOURNAL_SECONDS = 0  # a journal at every resume point
encode.CHUNK_CHARS = 1 << 18
write, writes = encode.SplitWriter.write, []
in_gc = "--ctrl-c-in-gc" in sys.argv  # Ctrl-C pressed while a gc callback runs, as XLA's often does

def slow_write(self, *args):  # slow enough to be interrupted half-way, however fast or busy the machine
    write(self, *args)
    time.sleep(0.05)
    writes.append(1)
    if in_gc and len(writes) == 3:
        gc.collect()  # its callbacks run now: `press` among them

def press(phase, info):
    if in_gc and len(writes) == 3 and phase == "start":
        signal.raise_signal(signal.SIGINT)
        sum(range(10))  # Python's handler runs here, inside the callback

encode.SplitWriter.write = slow_write
gc.callbacks.append(press)
sys.argv = ["minigpt", *(a for a in sys.argv[1:] if a != "--ctrl-c-in-gc")]  # the program, as its script starts it
from minigpt.cli import main
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_stops_prepare_and_the_next_prepare_resumes(
    tmp_path: Path, tinystories: Path, gpt2_dir: Path, workers: int
) -> None:
    """`minigpt prepare` interrupted once it has journaled training text: exit 130 and one line (before: the
    worker processes' tracebacks, or a Ctrl-C swallowed by XLA's gc callback and the build run on to exit 0),
    no temporary file outside the build's own resumable folder, and the next prepare makes the store an
    uninterrupted one makes."""
    from test_build import _assert_same_store, _journal

    from minigpt.data.build import prepare

    text = (tinystories / "train.txt").read_bytes()[:3_000_000]
    train = tmp_path / "train.txt"
    train.write_bytes(text[: text.rindex(b"<|endoftext|>")])
    data = DataConfig(paths=(str(train),), val_paths=(str(tinystories / "valid.txt"),), tokenizer="gpt2",
                      gpt2_dir=str(gpt2_dir), tokenize_workers=workers)  # fmt: skip
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-c", PREPARE, "prepare", "--data", str(train), "--val-data",
           str(tinystories / "valid.txt"), "--data.tokenizer", "gpt2", "--data.gpt2-dir", str(gpt2_dir),
           "--data.cache-dir", str(cut), "--data.tokenize-workers", str(workers)]  # fmt: skip

    def journaled(_: subprocess.Popen) -> bool:
        try:
            at = _journal(cut)["at"]
        except (ValueError, OSError):
            return False
        return at["split"] == "train" and (at["point"] or {}).get("offset", 0) > 0

    _stopped_in_one_line(*_interrupt(cmd, journaled))
    (build,) = (cut / "tokens").glob("*.tmp")
    left = [p.name for p in cut.rglob("*") if not p.is_relative_to(build) and p.suffix == ".tmp"]
    assert left == [] and _journal(cut)["at"]["split"] == "train"
    resumed = prepare(dataclasses.replace(data, cache_dir=str(cut)))
    _assert_same_store(resumed, prepare(dataclasses.replace(data, cache_dir=str(tmp_path / "whole"))))


@pytest.mark.slow
def test_a_ctrl_c_landing_in_a_gc_callback_still_stops_prepare(tmp_path: Path, tinystories: Path) -> None:
    """Python prints and drops an exception raised in a gc callback: before, the build ran on to exit 0."""
    text = (tinystories / "train.txt").read_bytes()[:2_000_000]
    train = tmp_path / "train.txt"
    train.write_bytes(text[: text.rindex(b"<|endoftext|>")])
    out = subprocess.run([sys.executable, "-c", PREPARE, "--ctrl-c-in-gc", "prepare", "--data", str(train),
                          "--data.cache-dir", str(tmp_path / "cache"), "--data.tokenize-workers", "1"],
                         capture_output=True, text=True, env=cli_env(), cwd=WORKDIR, timeout=600)  # fmt: skip
    _stopped_in_one_line(out.returncode, out.stderr)
    assert not list((tmp_path / "cache" / "tokens").glob("*/meta.json"))  # stopped, not finished


def test_train_without_a_preset_takes_the_accelerator_preset_where_jax_finds_one(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """On a TPU or GPU, `minigpt train` with no --preset trains the accelerator preset (with the flags given)
    and says so first; with --preset, or on a CPU, the preset is what it was. The backend is made to answer
    "tpu" here (no accelerator in CI); the steps still run on this CPU."""
    import jax

    from minigpt.cli import main

    run = tmp_path / "run"
    small = [*TINY_FLAGS, "--model.n-layers", "1", "--steps", "1", "--max-time", "0", "--sample-tokens", "0"]
    args = ["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"), *small]
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    main([*args, "--run-dir", str(run)])
    out = capsys.readouterr().out
    assert out.startswith("no --preset: training the accelerator preset on this "), out[:300]
    saved = json.loads((run / "config.json").read_text())
    accelerator = get_preset("accelerator")
    assert (
        saved["model"]["scan_layers"] == accelerator.model.scan_layers != get_preset("cpu").model.scan_layers
    )
    assert saved["schedule"]["peak_lr"] == accelerator.schedule.peak_lr
    assert saved["model"]["d_model"] == 32  # the flags given still apply
    main([*args, "--preset", "cpu", "--run-dir", str(tmp_path / "cpu")])
    assert "accelerator preset" not in capsys.readouterr().out
