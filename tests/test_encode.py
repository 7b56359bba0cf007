"""Encoding a corpus in worker processes: the same store as one process writes, and no worker outliving its
killed parent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DOCS, data_cfg, write_corpus

import minigpt.data.encode as encode_mod
from minigpt.data.build import prepare
from minigpt.data.tokenizer import BPETokenizer


@pytest.mark.slow
def test_worker_processes_write_the_same_store_as_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS * 5)
    monkeypatch.setattr(encode_mod, "CHUNK_CHARS", 2000)  # many chunks in flight, completing out of order
    one = prepare(data_cfg(corpus, tmp_path / "a", tokenize_workers=1))
    two = prepare(data_cfg(corpus, tmp_path / "b", tokenize_workers=2))
    assert two.meta["build"]["workers"] == 2
    for name in ("train.bin", "val.bin", "train.docs.npy", "val.docs.npy"):
        assert (one.path / name).read_bytes() == (two.path / name).read_bytes()
    assert one.meta["splits"] == two.meta["splits"]


def test_a_worker_that_starts_after_its_parent_died_leaves(tmp_path: Path) -> None:
    """A tokenizing worker is told its parent's pid: one still starting up when its prepare is killed would
    otherwise take the process it was handed to for its parent and wait forever. Here the pid given is one
    no process has, as a killed parent's; the worker leaves at once, quietly."""
    BPETokenizer.train(DOCS, 300).save(tmp_path / "tok")
    code = (
        "import sys, time\nimport minigpt.data.encode as encode\n"
        f"encode._worker_init({str(tmp_path / 'tok')!r}, 'uint16', parent=-1)\ntime.sleep(60)\nprint('stayed')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 1 and "stayed" not in out.stdout and not out.stderr, out.stderr[-2000:]
