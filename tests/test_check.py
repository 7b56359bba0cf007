"""`minigpt check RUN`: exit 0 on an intact run; each kind of damage is one line with what to do, and exit 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from minigpt.cli import main
from minigpt.data.store import TokenStore


def _check(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str]]:
    """`minigpt check ARGV` in this process: its exit status and its lines (stdout, then stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(["check", *argv])
        raise SystemExit(0)
    out = capsys.readouterr()
    return exc.value.code or 0, (out.out + out.err).strip().splitlines()


@pytest.fixture
def run(tiny_run: tuple[Path, Path, Path], tmp_path: Path) -> Path:
    """A copy of the session's 4-step run (checkpoints 2 and 4) to damage; its token store is the session's."""
    return Path(shutil.copytree(tiny_run[2], tmp_path / "run"))


def _problems(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("problem: ")]


def test_an_intact_run_verifies(run: Path, capsys: pytest.CaptureFixture) -> None:
    code, lines = _check(capsys, str(run))
    assert code == 0 and not _problems(lines), lines
    assert lines[-1].startswith(f"{run}: everything verifies (2 checkpoint(s), config.json, tokenizer")
    assert "1 token store(s)" in lines[-1] and "source file(s)" in lines[-1]
    assert _check(capsys, "--run-dir", str(run))[0] == 0


def test_a_checkpoint_with_changed_bytes_is_one_problem(run: Path, capsys: pytest.CaptureFixture) -> None:
    array = max((run / "checkpoints" / "4" / "state" / "ocdbt.process_0" / "d").iterdir(),
                key=lambda p: p.stat().st_size)  # fmt: skip
    data = bytearray(array.read_bytes())
    data[len(data) // 2] ^= 0xFF
    array.write_bytes(bytes(data))
    code, lines = _check(capsys, str(run))
    assert code == 1 and len(_problems(lines)) == 1, lines
    assert _problems(lines)[0].startswith("problem: checkpoint 4 is damaged (state/ocdbt.process_0/d/")
    assert "sets it aside" in _problems(lines)[0] and lines[-1].endswith("1 problem(s); 6 item(s) verified")
    assert (run / "checkpoints" / "4").is_dir()  # checking moves nothing


def test_a_checkpoint_without_manifest_is_a_note(run: Path, capsys: pytest.CaptureFixture) -> None:
    (run / "checkpoints" / "2" / "minigpt_manifest.json").unlink()
    code, lines = _check(capsys, str(run))
    assert code == 0 and any(
        line.startswith("note: checkpoint 2 has no minigpt_manifest.json") for line in lines
    )


def test_a_changed_source_and_a_damaged_store_are_problems(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus, cache, trained = tiny_run
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    own_corpus, own_cache = tmp_path / "corpus.txt", tmp_path / "cache"
    shutil.copy2(corpus, own_corpus)
    shutil.copytree(cache, own_cache)
    cfg = json.loads((run / "config.json").read_text())
    cfg["data"]["cache_dir"] = str(own_cache)
    (run / "config.json").write_text(json.dumps(cfg))
    record = json.loads((run / "data.json").read_text())
    record["sources"]["train"][0]["path"] = str(own_corpus)
    (run / "data.json").write_text(json.dumps(record))
    store = None  # the shared cache may hold stores other tests built: the run's is the one of its identity
    for meta_path in (own_cache / "tokens").glob("*/meta.json"):
        meta = json.loads(meta_path.read_text())
        for f in meta["sources"]["train"]:
            f["path"] = str(own_corpus)
        meta_path.write_text(json.dumps(meta))
        if TokenStore(meta_path.parent, meta).identity == record["store_identity"]:
            store = meta_path.parent
    assert store is not None
    assert _check(capsys, str(run))[0] == 0  # the copies are the run's data

    tokens = bytearray((store / "train.bin").read_bytes())
    tokens[len(tokens) // 2] ^= 0xFF  # same length, other bytes
    (store / "train.bin").write_bytes(bytes(tokens))
    code, lines = _check(capsys, str(run))
    assert code == 1 and _problems(lines) == [
        f"problem: token store {store}: train.bin or train.docs.npy differs from the sha256 its meta.json "
        "records; delete the folder and `minigpt prepare` (or `train`) rebuilds it"
    ], lines

    own_corpus.write_text(own_corpus.read_text().replace("Tom", "Tim"))
    with open(store / "train.bin", "ab") as f:
        f.write(b"\0\0")
    code, lines = _check(capsys, str(run))
    assert code == 1, lines
    problems = _problems(lines)
    assert any(f"source {own_corpus} changed since" in p for p in problems), problems
    assert any(f"token store {store}: train.bin holds" in p for p in problems), problems


def test_damaged_records_are_problems(run: Path, capsys: pytest.CaptureFixture) -> None:
    (run / "config.json").write_text("{ not json")
    (run / "data.json").write_text("[]")
    shutil.rmtree(run / "tokenizer")
    code, lines = _check(capsys, str(run))
    assert code == 1
    problems = _problems(lines)
    assert len(problems) == 3, lines
    assert problems[0].startswith("problem: config.json: ")
    assert problems[1].startswith(f"problem: no tokenizer saved in {run / 'tokenizer'}; `minigpt train`")
    assert problems[2].startswith(f"problem: {run / 'data.json'} is unreadable (not the record")


def test_a_config_edited_after_training_is_a_problem(run: Path, capsys: pytest.CaptureFixture) -> None:
    """config.json read whole but describing another model than the checkpoints hold (n_layers edited)."""
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"]["n_layers"] += 1
    (run / "config.json").write_text(json.dumps(cfg))
    code, lines = _check(capsys, str(run))
    assert code == 1 and len(_problems(lines)) == 1, lines
    assert _problems(lines)[0].startswith("problem: config.json does not fit the newest checkpoint (")


def test_a_replaced_run_tokenizer_is_blamed_not_the_healthy_store(
    run: Path, capsys: pytest.CaptureFixture
) -> None:
    """Another valid tokenizer in the run's tokenizer/ folder: the run's copy is the problem (it is not the one
    the checkpoints recorded); the token store, which still matches them, is not blamed."""
    from minigpt.data.tokenizer import BPETokenizer

    shutil.rmtree(run / "tokenizer")
    BPETokenizer.train(["other words entirely, and more of them"] * 3, vocab_size=290).save(run / "tokenizer")
    code, lines = _check(capsys, str(run))
    problems = _problems(lines)
    assert code == 1 and len(problems) == 1, lines
    assert (
        problems[0].startswith(f"problem: the run's tokenizer ({run / 'tokenizer'}) is bpe")
        and "token store" in problems[0]
    )
    assert "not bpe300-" in problems[0]


def test_not_a_run_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, lines = _check(capsys, str(tmp_path))
    assert code == 2 and lines == [
        f"minigpt: error: {tmp_path} is not a run directory (no config.json, no checkpoints/)"
    ]
