"""The persistent compilation cache: where it lives, that commands read back what earlier ones compiled, that a
torn or foreign entry costs a recompile (never a traceback), and that processes writing it at once leave
whole entries."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from conftest import WORKDIR, cli_env, run_cli

from minigpt.runtime.compile_cache import AtomicCache
from minigpt.runtime.files import user_cache_dir
from minigpt.training import hardware

GENERATE = ("--prompt", "Tom saw", "--max-new-tokens", "6", "--temperature", "0")


def test_the_cache_folder_is_minigpts_then_xdgs_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "own"))
    assert user_cache_dir() == tmp_path / "own"
    monkeypatch.delenv("MINIGPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "minigpt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "minigpt"


def test_a_torn_or_foreign_entry_reads_as_absent_with_one_warning_and_is_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cache = AtomicCache(tmp_path / "xla")
    assert cache.get("a") is None
    cache.put("a", b"program a" * 100)
    cache.put("b", b"program b")
    assert cache.get("a") == b"program a" * 100 and cache.get("b") == b"program b"
    assert sorted(p.name for p in (tmp_path / "xla").iterdir()) == ["a.xla", "b.xla"]  # no temporary left
    whole = cache.file("a").read_bytes()
    cache.file("a").write_bytes(
        whole[: len(whole) // 2]
    )  # a writer killed half way, in a cache without renames
    cache.file("b").write_bytes(b"\x00garbage")
    assert cache.get("a") is None and cache.get("b") is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "minigpt: warning: unreadable entries in the compilation cache"
    )
    cache.put("a", b"program a again")
    assert cache.get("a") == b"program a again"


def _measured_machine(cache: Path) -> Path:
    """A fresh cache folder holding this session's CPU measurements, taken as settled: its commands measure
    no peak and probe no dtype, which is not what these tests are about."""
    cache.mkdir()
    session = hardware.cache_path()
    machine = json.loads(session.read_text()) if session.is_file() else {}
    settled = {host: {**entry, "agreeing": hardware.SETTLED} for host, entry in machine.items()}
    (cache / "machine.json").write_text(json.dumps(settled))
    return cache


def _entries(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def _generate(run: Path, cache: Path, *flags: str, **env: str) -> subprocess.CompletedProcess:
    out = run_cli(
        "generate", "--run", str(run), *GENERATE, *flags, env={"MINIGPT_CACHE_DIR": str(cache), **env}
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return out


def test_a_command_reads_back_what_the_last_compiled_and_recompiles_over_bad_entries(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    run, cache = tiny_run[2], _measured_machine(tmp_path / "cache")
    cold = _generate(run, cache)
    folder = cache / "xla"
    written = _entries(folder)
    assert written and all(name.endswith(".xla") for name in written)
    warm = _generate(run, cache)
    assert _entries(folder) == written  # every program was read back: none compiled and written again
    assert warm.stdout == cold.stdout and not warm.stderr.strip()

    not_a_program = zlib.compress(b"not a program" * 100)

    def foreign(p: Path) -> None:  # whole and digested, yet no program: something else writing this format
        AtomicCache(folder).put(p.name.removesuffix(".xla"), not_a_program)

    torn = (
        lambda p: p.write_bytes(b"\x00garbage" * 10),
        lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    )
    for damage in (*torn, foreign):
        for p in folder.iterdir():
            damage(p)
        again = _generate(run, cache)
        assert again.stdout == cold.stdout
        assert again.stderr.strip().splitlines() == [
            f"minigpt: warning: unreadable entries in the compilation cache {folder} are compiled again and replaced"
        ]
        entries = [AtomicCache(folder).get(name.removesuffix(".xla")) for name in written]
        assert all(entry and entry != not_a_program for entry in entries)  # replaced


def test_the_flag_turns_it_off_and_jaxs_own_variable_wins(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    run, cache = tiny_run[2], _measured_machine(tmp_path / "cache")
    _generate(run, cache, "--compile-cache", "off")
    assert not (cache / "xla").exists() or not any((cache / "xla").iterdir())
    jax_own = tmp_path / "jax"
    _generate(
        run, cache, JAX_COMPILATION_CACHE_DIR=str(jax_own), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )
    assert any(jax_own.iterdir()) and not any(p.suffix == ".xla" for p in jax_own.iterdir())
    assert not (cache / "xla").exists() or not any((cache / "xla").iterdir())
    (tmp_path / "file").write_text("")
    bad = run_cli("generate", "--run", str(run), "--compile-cache", str(tmp_path / "file" / "xla"))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"minigpt: error: --compile-cache {tmp_path / 'file' / 'xla'}: cannot make the folder (Not a directory)"
    ]


COMPILE = """
import json, sys
import jax, jax.numpy as jnp
from minigpt.runtime import compile_cache

events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
compile_cache.use(sys.argv[1])

def f(x):
    for i in range(40):
        x = jnp.sin(x @ x + i)
    return x.sum()

print(float(jax.jit(f)(jnp.ones((16, 16)))))
print(json.dumps({e: events.count(f"/jax/compilation_cache/{e}") for e in ("cache_hits", "cache_misses")}))
"""


def test_processes_compiling_into_one_cache_at_once_leave_whole_entries(tmp_path: Path) -> None:
    folder = tmp_path / "xla"
    cmd = [sys.executable, "-c", COMPILE, str(folder)]
    both = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                             cwd=WORKDIR) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in both]
    assert all(p.returncode == 0 and not err.strip() for p, (_, err) in zip(both, outs, strict=True)), outs
    third = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=WORKDIR, timeout=600)
    assert third.returncode == 0 and not third.stderr.strip(), third.stderr
    value, counts = third.stdout.splitlines()
    assert value == outs[0][0].splitlines()[0]
    assert json.loads(counts)["cache_hits"] >= 1 and json.loads(counts)["cache_misses"] == 0
    assert all(p.suffix == ".xla" for p in folder.iterdir())  # no temporary left behind


def test_a_full_disk_names_the_entry_it_could_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A write that fails for space has no file name in its error ("No space left on device: None" once):
    the warning names the entry."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): no small disk to fill")
    try:
        cache = AtomicCache(disk)
        cache.put("big", b"x" * 200_000)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    err = capsys.readouterr().err
    assert f"cannot write to the compilation cache (No space left on device: {disk / 'big.xla'})" in err, err


def test_train_warns_once_about_torn_entries_as_generate_does(tmp_path: Path, small_corpus: Path) -> None:
    """The same one warning line from `train` (the docs promise it of every command), and the run trains."""
    from conftest import TINY_FLAGS

    cache = _measured_machine(tmp_path / "cache")
    argv = ["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "tokens"), *TINY_FLAGS,
            "--run-dir", str(tmp_path / "run"), "--steps", "2", "--max-time", "0", "--overwrite",
            "--sample-tokens", "0"]  # fmt: skip
    first = run_cli(*argv, env={"MINIGPT_CACHE_DIR": str(cache)})
    assert first.returncode == 0, first.stderr[-2000:]
    folder = cache / "xla"
    for p in folder.iterdir():
        p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    again = run_cli(*argv, env={"MINIGPT_CACHE_DIR": str(cache)})
    assert again.returncode == 0, again.stderr[-2000:]
    warning = f"minigpt: warning: unreadable entries in the compilation cache {folder} are compiled again and replaced"
    assert again.stderr.count(warning) == 1, again.stderr[-2000:]
