"""Faults a careful user and an unlucky machine produce, driven through the command line: a full disk, a
read-only run directory, two trainers in one directory, exports and overwrites aimed at a run, a config that
no longer fits its checkpoints, data that changed. Each must end in one line, and lose no checkpoint,
token store or config."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY_FLAGS, WORKDIR, cli_env, run_cli, start_cli

pytestmark = pytest.mark.slow


def _flags(corpus: Path, cache: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), "--data.cache-dir", str(cache), "--run-dir", str(run),
            *TINY_FLAGS, "--log-every", "1", "--eval-every", "1000", "--sample-tokens", "4", *extra]  # fmt: skip


def _one_line_error(out: subprocess.CompletedProcess, code: int = 2) -> str:
    assert out.returncode == code, out.stderr[-3000:]
    lines = [
        line
        for line in out.stderr.strip().splitlines()
        if line.strip() and not line.startswith(("warning:", "tokenize:", "training a "))
    ]
    assert len(lines) == 1 and lines[0].startswith("minigpt: error: "), out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr
    return lines[0]


def _refused(capsys: pytest.CaptureFixture, argv: list[str], code: int = 2) -> str:
    """`minigpt ARGV` run in this process, for commands that fail before they train or generate (a process
    would add only its start-up): `_one_line_error`'s checks on its exit status and what it printed."""
    from minigpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    return _one_line_error(
        subprocess.CompletedProcess(argv, exc.value.code, "", capsys.readouterr().err), code
    )


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the lock file aside) and its content hash."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def trained(tiny_run: tuple[Path, Path, Path]) -> tuple[Path, Path, Path]:
    """(corpus, cache, run): a 4-step run with checkpoints at steps 2 and 4, copied by each test that needs one."""
    return tiny_run


def _copy(trained: tuple[Path, Path, Path], tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained[2], run)
    return run


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): no small disk to fill")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_during_saves_loses_no_checkpoint_and_no_config(trained, tmp_path: Path) -> None:
    corpus, cache, _ = trained
    with _tmpfs(tmp_path / "disk", "600k") as disk:
        big = ["--model.d-model", "64", "--model.d-ff", "256", "--ckpt-every", "2"]
        out = run_cli(*_flags(corpus, cache, disk / "run", "--steps", "12", *big))
        # The disk fills during a checkpoint (exit 1, naming the save) or during another write (exit 2).
        line = _one_line_error(out, code=1 if "saving the" in out.stderr else 2)
        assert "earlier checkpoints are intact" in line or "No space left on device" in line, line
        config = json.loads((disk / "run" / "config.json").read_text())  # whole, not truncated
        assert config["steps"] == 12
        done = sorted(int(p.name) for p in (disk / "run" / "checkpoints").iterdir() if p.name.isdigit())
        if done:  # whatever was saved before the disk filled restores
            ev = run_cli("eval", "--run", str(disk / "run"))
            assert ev.returncode == 0 and f"step {done[-1]} |" in ev.stdout, ev.stderr[-2000:]


def test_a_full_disk_while_tokenizing_leaves_no_half_store(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus, _, _ = trained
    big = tmp_path / "big.txt"
    big.write_text(corpus.read_text() * 40)
    with _tmpfs(tmp_path / "disk", "64k") as disk:
        _refused(
            capsys,
            ["prepare", "--data", str(big), "--data.cache-dir", str(disk), "--data.bpe-vocab-size", "300"],
        )
        assert not list(disk.rglob("meta.json"))  # no store that looks complete


def test_a_read_only_run_directory_is_one_line_and_unchanged(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus, cache, _ = trained
    run = _copy(trained, tmp_path)
    before = _snapshot(run)
    with _tmpfs(tmp_path / "ro", "8m") as ro:
        shutil.copytree(run, ro / "run")
        if subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True).returncode:
            pytest.skip("cannot remount the tmpfs read-only")
        line = _refused(capsys, _flags(corpus, cache, ro / "run", "--steps", "6", "--ckpt-every", "2"))
        assert "Read-only file system" in line
        assert _snapshot(ro / "run") == before


def test_a_second_trainer_in_the_same_directory_is_refused(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus, cache, _ = trained
    run = _copy(trained, tmp_path)
    cmd = _flags(corpus, cache, run, "--steps", "100000", "--ckpt-every", "1000")
    # far more steps than it gets to: it must still be training when the second starts (compiles are cached)
    first = start_cli(*cmd)
    try:
        # Its first step: from then on it holds the lock and answers SIGTERM by saving and stopping (the
        # signal follows the second's refusal at once, and before its handler it would just kill it).
        started = next((line for line in first.stdout if line.startswith("step")), None)
        assert started, first.stderr.read()[-2000:]
        # The second, in this process: refused at once by the first's lock.
        line = _refused(capsys, _flags(corpus, cache, run, "--steps", "400", "--seed", "7"))
        assert f"is in use by another training run (pid {first.pid}" in line
        first.send_signal(signal.SIGTERM)  # the first saves and stops; its metrics are its own
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err[-2000:]
    finally:
        first.kill()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert len(train_steps) == len(set(train_steps))  # one writer: no step logged twice


def test_export_and_import_never_write_over_a_run_or_their_source(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(trained, tmp_path)
    other = _copy(trained, tmp_path / "other")
    before = _snapshot(run)
    for args in (
        ["export", "--run", str(run), "--format", "hf", "--out", str(run), "--overwrite"],
        ["export", "--run", str(run), "--format", "hf", "--out", str(other), "--overwrite"],
        ["export", "--run", str(run), "--out", str(run / "checkpoints"), "--overwrite"],
        ["import", "--hf", str(run), "--out", str(other), "--overwrite"],
    ):
        line = _refused(capsys, args)
        assert "own source" in line or "training run directory" in line, line
    assert _snapshot(run) == before
    assert (other / "checkpoints").is_dir() and (other / "metrics.jsonl").is_file()


def test_overwrite_deletes_nothing_until_the_command_is_valid(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus, cache, _ = trained
    run = _copy(trained, tmp_path)
    before = _snapshot(run)
    for bad in (["--batch-size", "5000"], ["--val-data", str(tmp_path / "short.txt")]):
        (tmp_path / "short.txt").write_text("Tom.\n")
        line = _refused(capsys, _flags(corpus, cache, run, "--steps", "4", "--overwrite", *bad))
        assert "fewer than one global batch" in line or "validation text" in line, line
        assert _snapshot(run) == before


def test_a_short_validation_split_stops_before_any_step(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus, cache, _ = trained
    (tmp_path / "short.txt").write_text("Tom.\n")
    argv = _flags(corpus, cache, tmp_path / "run", "--val-data", str(tmp_path / "short.txt"))
    assert f"the validation text ({tmp_path / 'short.txt'}) has fewer than" in _refused(capsys, argv)
    assert (
        not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    )


def test_a_checkpoint_that_no_longer_fits_the_config_is_refused_and_kept(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus, cache, _ = trained
    run = _copy(trained, tmp_path)
    (run / "config.json").unlink()  # the config that would have caught the change is gone
    before = _snapshot(run)
    for command in (
        _flags(corpus, cache, run, "--steps", "6", "--model.d-ff", "128"),
        ["generate", "--run", str(run)],
    ):
        if command[0] == "generate":
            shutil.copy(trained[2] / "config.json", run / "config.json")
            cfg = json.loads((run / "config.json").read_text())
            cfg["model"]["d_ff"] = 128
            (run / "config.json").write_text(json.dumps(cfg))
            before = _snapshot(run)
        line = _refused(capsys, command)
        assert "does not fit this config" in line and "mlp.up.kernel: (32, 64) -> (32, 128)" in line, line
        assert _snapshot(run) == before  # nothing set aside as damaged, no config rewritten
    assert not list(run.glob("damaged-checkpoint-*"))


ABANDONED_READS = """
import dataclasses, gc, inspect, json, sys
import jax
from minigpt.config import ConfigError
from minigpt.training.checkpoint import Checkpointer
from minigpt.training.runs import inference_config, run_config
from minigpt.training.trainer import build

cfg = inference_config(run_config(sys.argv[1]), len(jax.devices()))
# other head widths: only the QK-norm scales differ, so the reads of most arrays are in flight when it fails
setup = build(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_heads=8)))
left = []
sys.unraisablehook = lambda u: left.append(u.object.__name__) if inspect.iscoroutine(u.object) else None
refused = 0
for _ in range(10):  # how many reads a failed one leaves in flight depends on timing: try it ten times
    try:
        Checkpointer(sys.argv[2]).restore(setup.abstract_state.saved())
    except ConfigError:
        refused += 1
    gc.collect()
print(json.dumps({"refused": refused, "left": left}))
"""


def test_a_deleted_config_and_another_model_is_one_line_and_no_orbax_tracebacks(
    trained, tmp_path: Path
) -> None:
    """`rm RUN/config.json`, then a resume with another --model.d-model: the one-line refusal, and nothing
    after it. The failed read leaves Orbax's reads of the other arrays suspended; collected at exit they once
    printed a traceback each ('Exception ignored in: <coroutine object _read_array_index_and_device_put')."""
    corpus, cache, _ = trained
    run = _copy(trained, tmp_path)
    (run / "config.json").unlink()
    out = run_cli(*_flags(corpus, cache, run, "--steps", "6", "--model.d-model", "64"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    assert "does not fit this config" in out.stderr
    script = [sys.executable, "-c", ABANDONED_READS, str(trained[2]), str(run)]
    found = subprocess.run(script, capture_output=True, text=True, env=cli_env(), cwd=WORKDIR, timeout=600)
    assert found.returncode == 0, found.stderr[-3000:]
    assert json.loads(found.stdout.splitlines()[-1]) == {"refused": 10, "left": []}
    assert "Exception ignored" not in found.stderr


@pytest.mark.parametrize("command", ["generate", "eval", "export"])
def test_a_config_edited_to_more_layers_is_one_line_in_every_reader(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture, command: str
) -> None:
    """More layers in config.json than the checkpoint holds: a partial read would leave the new layers'
    arrays unread (once a TypeError deep in JAX); the reader names what the checkpoint lacks instead."""
    run = _copy(trained, tmp_path)
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"]["n_layers"] = 2
    (run / "config.json").write_text(json.dumps(cfg))
    extra = {"generate": ["--max-new-tokens", "2"], "eval": [], "export": ["--out", str(tmp_path / "x.npz")]}
    line = _refused(capsys, [command, "--run", str(run), *extra[command]])
    assert "does not fit this config" in line and "-> (" in line, line


def test_eval_reads_the_runs_own_data_from_any_directory_and_refuses_changed_data(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "corpus.txt").write_text(
        "".join(f"Mia had a cat {i}. The end.\n<|endoftext|>\n" for i in range(300))
    )
    env = cli_env()  # as run_cli's, in another working directory
    flags = _flags(Path("corpus.txt"), Path("cache"), Path("run"), "--steps", "2", "--ckpt-every", "2")
    cli = [sys.executable, "-m", "minigpt.cli"]
    trained = subprocess.run([*cli, *flags], cwd=work, capture_output=True, text=True, env=env)
    assert trained.returncode == 0, trained.stderr[-2000:]
    here = subprocess.run([*cli, "eval", "--run", "run"], cwd=work, capture_output=True, text=True, env=env)
    there = subprocess.run(
        [*cli, "eval", "--run", str(work / "run")], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert here.returncode == 0 and here.stdout == there.stdout, (here.stderr[-2000:], there.stderr[-2000:])
    with open(work / "corpus.txt", "a") as f:
        f.write("A new story.\n<|endoftext|>\n")
    monkeypatch.chdir(work)  # the refusal (no evaluation to run) in this process, from the same directory
    assert "has changed since" in _refused(capsys, ["eval", "--run", "run"])


def _cli_as(user: list[str], *args: str, umask: int = 0o022, **env: str) -> subprocess.CompletedProcess:
    """`minigpt ARGS` as `run_cli` runs it, under `umask`, started through `user` (a setpriv prefix, or [])."""
    return subprocess.run(
        [*user, sys.executable, "-m", "minigpt.cli", *args],
        capture_output=True, text=True, env=cli_env(**env), cwd=WORKDIR, umask=umask, timeout=600,
    )  # fmt: skip


OTHER = 65534
"""The uid that owns the "other" user's files in the second-user tests (nobody)."""

NOT_OWNER = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
"""uid 0 without the capabilities that let root read and write anyone's files: to files owned by OTHER, just
another user. (A real second user could not run this Python, kept under /root.)"""

ROOT_AS_OTHER = ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups"] + [
    f"--{kind}-caps=+dac_override,+dac_read_search" for kind in ("inh", "ambient")
] + ["--"]  # fmt: skip
"""root's power over files, under uid OTHER: what it writes belongs to someone other than NOT_OWNER."""


@pytest.fixture(scope="module")
def second_user() -> None:
    """Skip unless this process can run commands as NOT_OWNER and ROOT_AS_OTHER (root, with setpriv)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as a second user")
    for user in (NOT_OWNER, ROOT_AS_OTHER):
        if subprocess.run([*user, sys.executable, "-c", ""], capture_output=True).returncode:
            pytest.skip(f"cannot start a process as a second user ({' '.join(user)})")


def _modes(*roots: Path) -> set[tuple[str, int]]:
    """('f' or 'd', permission bits) of everything under `roots`, the roots included."""
    return {
        ("d" if p.is_dir() else "f", stat.S_IMODE(p.stat().st_mode))
        for root in roots
        for p in [root, *root.rglob("*")]
    }


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_every_file_a_run_writes_follows_the_umask(trained, tmp_path: Path, mask: int) -> None:
    corpus, run, cache = trained[0], tmp_path / "run", tmp_path / "cache"
    from minigpt.cli import main

    for args in (
        _flags(corpus, cache, run, "--steps", "2", "--ckpt-every", "2"),
        ["generate", "--run", str(run), "--max-new-tokens", "4"],
    ):
        out = _cli_as([], *args, umask=mask)
        assert out.returncode == 0, out.stderr[-2000:]
    before = os.umask(mask)  # the exports in this process, under the same umask
    try:
        main(["export", "--run", str(run), "--out", str(tmp_path / "exports" / "run.npz")])
        main(["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "exports" / "hf")])
    finally:
        os.umask(before)
    assert (run / "checkpoints" / "2").is_dir() and (run / "loss.png").is_file()
    assert _modes(run, cache, tmp_path / "exports") == {("f", 0o666 & ~mask), ("d", 0o777 & ~mask)}


def test_another_user_can_generate_from_a_run_made_under_umask_022(
    trained, tmp_path: Path, second_user: None
) -> None:
    mask = os.umask(0o022)
    os.umask(mask)
    if mask != 0o022:
        pytest.skip(f"the session's run was written under umask {mask:03o}, not 022")
    run = _copy(trained, tmp_path)
    subprocess.run(["chown", "-R", f"{OTHER}:{OTHER}", str(run)], check=True)
    out = _cli_as(NOT_OWNER, "generate", "--run", str(run), "--max-new-tokens", "4")
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_run_another_user_cannot_read_is_named_as_such(trained, tmp_path: Path, second_user: None) -> None:
    """A run made under umask 077 by someone else: generate named model.safetensors, a file no run has (its
    probe for a transformers folder was refused first); it now says the run cannot be read."""
    run = _copy(trained, tmp_path)
    run.chmod(0o700)
    subprocess.run(["chown", "-R", f"{OTHER}:{OTHER}", str(run)], check=True)
    for command in (["generate", "--max-new-tokens", "2"], ["eval"]):
        out = _cli_as(NOT_OWNER, command[0], "--run", str(run), *command[1:])
        assert out.returncode == 2, out.stderr[-2000:]
        assert (
            out.stderr.strip()
            == f"minigpt: error: {run} cannot be read by you (Permission denied); ask its owner, or copy it readable"
        )


def test_another_user_can_evaluate_a_run_whose_token_store_someone_else_made(
    trained, tmp_path: Path, second_user: None
) -> None:
    """eval only reads a complete token store: it needs no write access to the store's lock file, which
    belongs to whoever built the store (here OTHER, under umask 022: not writable by the evaluating user)."""
    run = _copy(trained, tmp_path)
    locks = list((trained[1] / "tokens").glob("*.lock"))
    assert locks and all(lock.stat().st_mode & 0o022 == 0 for lock in locks)
    subprocess.run(["chown", f"{OTHER}:{OTHER}", *map(str, locks)], check=True)
    try:
        out = _cli_as(NOT_OWNER, "eval", "--run", str(run))
    finally:
        subprocess.run(["chown", "0:0", *map(str, locks)], check=True)
    assert out.returncode == 0 and "val bits/byte" in out.stdout, out.stderr[-2000:]


def test_after_root_resumes_a_users_run_its_owner_can_still_evaluate_it(
    trained, tmp_path: Path, second_user: None
) -> None:
    corpus, cache, _ = trained
    run = _copy(trained, tmp_path)  # the owner's (uid 0, written under umask 022)
    resumed = _cli_as(
        ROOT_AS_OTHER, *_flags(corpus, cache, run, "--steps", "6", "--ckpt-every", "2"),
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "root-jax-cache"),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (run / "data.json").stat().st_uid == OTHER  # rewritten by "root"
    out = _cli_as(NOT_OWNER, "eval", "--run", str(run))
    assert out.returncode == 0 and "step 6 |" in out.stdout, out.stderr[-2000:]


def test_a_budget_longer_than_any_run_ends_at_steps(trained, tmp_path: Path) -> None:
    """--max-time 1e308 holds more steps than a float can count: the run ends at --steps, as without a budget."""
    corpus, cache, _ = trained
    out = run_cli(
        *_flags(corpus, cache, tmp_path / "run", "--steps", "14", "--max-time", "1e308", "--max-epochs", "0")
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "done: step 14" in out.stdout


def test_a_full_disk_during_export_names_the_file_and_leaves_no_temporary(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(trained, tmp_path)
    with _tmpfs(tmp_path / "disk", "64k") as disk:
        for target, fmt in ((disk / "run.npz", "minigpt"), (disk / "hf", "hf")):
            line = _refused(capsys, ["export", "--run", str(run), "--format", fmt, "--out", str(target)])
            assert "No space left on device" in line and str(target) in line, line
            assert not list(disk.iterdir())


def test_exports_and_imports_named_with_254_characters_are_written(trained, tmp_path: Path) -> None:
    from minigpt.cli import main

    run = _copy(trained, tmp_path)
    npz, hf = tmp_path / ("e" * 250 + ".npz"), tmp_path / ("h" * 254)
    for args in (["--out", str(npz)], ["--format", "hf", "--out", str(hf)], ["--format", "hf", "--out", str(hf),
                 "--overwrite"]):  # fmt: skip
        main(["export", "--run", str(run), *args])  # in this process: an error exits, failing the test
    mine = tmp_path / "imported.tmp"  # a folder of the user's, named as an import once staged its run
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    imported = tmp_path / ("i" * 254)
    for out in (imported, tmp_path / "imported"):
        main(["import", "--hf", str(hf), "--out", str(out)])
    assert (mine / "notes.txt").read_text() == "mine"
    names = ["run", npz.name, hf.name, imported.name, "imported", mine.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    assert (hf / "model.safetensors").is_file() and (imported / "checkpoints" / "0").is_dir()


def test_after_every_checkpoint_was_set_aside_train_refuses_to_start_again_at_step_0(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(trained, tmp_path)
    for step in (2, 4):
        meta = run / "checkpoints" / str(step) / "state" / "_sharding"
        meta.write_bytes(meta.read_bytes()[:-8] + b"\xff" * 8)  # same size, other bytes
    logged = (run / "metrics.jsonl").read_bytes()
    for _ in range(2):  # the first sets both aside; the second finds only damaged-checkpoint-*
        line = _refused(capsys, _flags(*trained[:2], run, "--steps", "6", "--ckpt-every", "2"))
        assert "damaged-checkpoint-2, damaged-checkpoint-4" in line and "--overwrite" in line, line
        assert "minigpt check" in line
    assert (run / "metrics.jsonl").read_bytes() == logged  # no step trained or logged twice
    again = run_cli(*_flags(*trained[:2], run, "--steps", "2", "--ckpt-every", "2", "--overwrite"))
    assert again.returncode == 0 and "resumed" not in again.stdout, again.stderr[-2000:]


def test_document_attention_on_text_of_one_document_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from minigpt.cli import main  # in this process: an error exits, failing the test

    (tmp_path / "book.txt").write_text("".join(f"Tom saw a red ball {i}. They played.\n" for i in range(300)))
    (tmp_path / "val.txt").write_text("Mia had a cat. The end.\n<|endoftext|>\n" * 20)
    flags = _flags(tmp_path / "book.txt", tmp_path / "cache", tmp_path / "run", "--steps", "1")
    main([*flags, "--val-data", str(tmp_path / "val.txt"), "--model.document-attention"])
    out = capsys.readouterr().out
    assert (
        "warning: --model.document-attention masks nothing: the training text of the corpus is one document "
        "(no <|endoftext|> inside it); to split it, pass --data.separator blank-line"
    ) in out, out[-2000:]


def test_a_token_file_changed_after_training_stops_eval_and_train_in_one_line(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Valid tokens copied over others in the store's val.bin and train.bin (same size): eval reported
    another loss with exit 0, and a resume trained on them. Both now stop in one line naming the file."""
    corpus, _, _ = trained
    cache, run = tmp_path / "cache", tmp_path / "run"
    assert run_cli(*_flags(corpus, cache, run, "--steps", "2")).returncode == 0
    store = next((cache / "tokens").glob("*/meta.json")).parent
    for split in ("val", "train"):
        data = bytearray((store / f"{split}.bin").read_bytes())
        data[len(data) // 2 : len(data) // 2 + 32] = data[:32]
        (store / f"{split}.bin").write_bytes(bytes(data))
    line = _refused(capsys, ["eval", "--run", str(run)])
    assert f"token store {store}: val.bin bytes " in line and "minigpt prepare" in line, line
    line = _refused(capsys, _flags(corpus, cache, run, "--steps", "40"))
    assert f"token store {store}: " in line and ".bin bytes " in line, line


def test_a_truncated_run_tokenizer_is_one_line_in_every_reader_and_train_repairs_it(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """tokenizer.json cut short: generate, eval and export each say so in one line (they ended in a Rust
    parser's traceback); train, whose checkpoints recorded the store's tokenizer, rewrites it and goes on."""
    from minigpt.cli import main

    corpus, cache, _ = trained
    run = _copy(trained, tmp_path)
    vocab = run / "tokenizer" / "tokenizer.json"
    vocab.write_bytes(vocab.read_bytes()[:300])
    for command in (
        ["generate", "--max-new-tokens", "2"],
        ["eval"],
        ["export", "--out", str(tmp_path / "x.npz")],
    ):
        line = _refused(capsys, [command[0], "--run", str(run), *command[1:]])
        assert f"the tokenizer in {run / 'tokenizer'} is unreadable (" in line, line
    out = run_cli(*_flags(corpus, cache, run, "--steps", "6"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"note: the tokenizer in {run / 'tokenizer'} is unreadable" in out.stdout
    with pytest.raises(SystemExit) as exc:
        main(["check", str(run)])
        raise SystemExit(0)
    assert exc.value.code in (0, None), capsys.readouterr()


@pytest.mark.parametrize("record", ["{ not json", "[1, 2]", '{"sources": 3}'])
def test_an_edited_data_record_is_one_line_in_eval_and_train(
    trained, tmp_path: Path, capsys: pytest.CaptureFixture, record: str
) -> None:
    """data.json that is not JSON, or JSON of another shape (once a TypeError or AttributeError)."""
    corpus, cache, _ = trained
    run = _copy(trained, tmp_path)
    (run / "data.json").write_text(record)
    for argv in (["eval", "--run", str(run)], _flags(corpus, cache, run, "--steps", "6")):
        line = _refused(capsys, argv)
        assert f"{run / 'data.json'} is unreadable (" in line and "restore it or retrain" in line, line
