"""Atomic writes and the run-directory lock."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from minigpt.config import ConfigError, TrainConfig, load_json, save_json
from minigpt.runtime.files import (
    RunDirLock,
    atomic_folder,
    atomic_open,
    temporary_folder,
    umask,
    write_bytes,
    write_json,
    write_text,
)


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "config.json"
    write_json(target, {"steps": 600})
    with pytest.raises(OSError, match="disk full"), atomic_open(target) as f:
        f.write('{"steps": 6')  # half of the new content, then the disk fills
        raise OSError(28, "disk full")
    assert target.read_text() == '{\n  "steps": 600\n}'
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    write_text(target, "new")
    assert target.read_text() == "new"


def test_save_json_replaces_a_config_whole(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    save_json(TrainConfig(steps=5), str(path))
    save_json(TrainConfig(steps=7), str(path))
    assert load_json(str(path)).steps == 7 and len(list(tmp_path.iterdir())) == 1


def _hold_lock(run_dir: str, ready: multiprocessing.Event, release: multiprocessing.Event) -> None:
    with RunDirLock(run_dir):
        ready.set()
        release.wait(30)


def test_one_trainer_per_run_directory_and_the_lock_dies_with_its_holder(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(ConfigError, match=rf"in use by another training run \(pid {holder.pid} on "):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()  # killed, not released: the kernel drops its flock
        holder.join()
    with RunDirLock(tmp_path) as lock:
        assert lock.path.read_text().startswith(f"pid {os.getpid()} ")


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_written_files_and_folders_get_the_mode_a_plain_open_would(tmp_path: Path, mask: int) -> None:
    with _umask(mask):
        assert umask() == mask
        write_text(tmp_path / "config.json", "{}")
        (tmp_path / "plain.txt").write_text("{}")
        folder = temporary_folder(tmp_path, "hf")
    assert stat.S_IMODE((tmp_path / "config.json").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask


def test_a_target_name_of_254_characters_is_written_and_leaves_no_temporary(tmp_path: Path) -> None:
    name = "x" * 250 + ".npz"
    write_bytes(tmp_path / name, b"data")
    folder = temporary_folder(tmp_path, name)
    assert (tmp_path / name).read_bytes() == b"data" and len(folder.name) < 255
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, folder.name])


def test_atomic_folder_replaces_the_old_folder_only_when_the_new_one_is_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(OSError), atomic_folder(out) as tmp:  # a full disk half-way through
        (tmp / "a.txt").write_text("new")
        raise OSError(28, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "old.txt").read_text() == "old"
    with atomic_folder(out) as tmp:
        (tmp / "a.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in out.iterdir()] == [
        "a.txt"
    ]
