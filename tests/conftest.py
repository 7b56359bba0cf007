"""Shared fixtures: real text from ../shared/data (skipped with a reason when absent) and small corpora."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TINYSTORIES = SHARED_DATA / "tinystories"
GPT2_DIR = SHARED_DATA / "gpt2"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One token cache per test session: tests never read a user's cache, and real-data tests share work."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tinystories() -> Path:
    if not (TINYSTORIES / "train.txt").is_file():
        pytest.skip(f"real TinyStories text not found at {TINYSTORIES} (the shared data folder)")
    return TINYSTORIES


@pytest.fixture(scope="session")
def gpt2_dir() -> Path:
    if not (GPT2_DIR / "vocab.bpe").is_file():
        pytest.skip(f"GPT-2 BPE files not found at {GPT2_DIR} (the shared data folder)")
    return GPT2_DIR


def write_corpus(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(f"{d}\n<|endoftext|>\n" for d in docs))
    return path


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    """~200 short made-up documents: enough for a byte-level BPE and a few batches, built in milliseconds."""
    names = ["Tom", "Mia", "Sam", "Lily", "Ben"]
    things = ["a red ball", "a big tree", "the blue sea", "a small cat", "a kind dog"]
    docs = [
        f"{names[i % 5]} saw {things[(i * 3) % 5]}. {names[(i + 1) % 5]} said hello to {things[(i + 2) % 5]}. "
        f"They played all day and were happy. The end {i}."
        for i in range(200)
    ]
    return write_corpus(tmp_path / "corpus.txt", docs)


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python -m minigpt.cli ...` as a user would, capturing output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "minigpt.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
    )


def run_on_devices(code: str, devices: int = 8, timeout: float = 900) -> dict:
    """Run `code` in a fresh Python with `devices` emulated CPU devices; it must print one JSON line last.

    XLA fixes the device count when JAX starts, so multi-device tests each get their own process."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "PYTHONUNBUFFERED": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
