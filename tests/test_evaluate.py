"""Evaluation (evaluate.py): `minigpt eval`'s flags and inputs refused in one line, where task results go, the
validation line, and the install hint when lm-eval is missing. The validation loop itself is covered by
test_trainer.py and test_mixture.py, the figures end to end by test_cli.py and test_harness.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import minigpt.inference
from minigpt.config import ConfigError, TrainConfig
from minigpt.inference.evaluate import EvalConfig, format_validation, import_harness, read_texts, tasks_path


def test_task_names_split_on_commas_and_spaces_as_train_does() -> None:
    assert EvalConfig(run="r", tasks=("a,b", "c", ",d,")).tasks == ("a", "b", "c", "d")
    assert TrainConfig(eval_tasks=("a,b", "c", ",d,")).eval_tasks == ("a", "b", "c", "d")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"batches": -1}, "--batches must be >= 0"),
        ({"batch_size": 0}, "--batch-size and --tensor must be >= 1"),
        ({"tensor": 0}, "--batch-size and --tensor must be >= 1"),
        ({"limit": 0.0}, "--limit must be > 0 (a count, or a fraction below 1), got 0.0"),
    ],
)
def test_bad_flags_are_one_line(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        EvalConfig(run="r", **flags)


def test_texts_that_cannot_be_measured_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Once upon a time.")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("Málaga".encode("latin-1"))
    assert read_texts((str(tmp_path / "a.txt"),)) == ["Once upon a time."]
    with pytest.raises(ConfigError, match=r"empty\.txt is empty: there is nothing to measure"):
        read_texts((str(tmp_path / "a.txt"), str(tmp_path / "empty.txt")))
    for name in ("latin1.txt", "missing.txt"):
        with pytest.raises(ConfigError, match=f"cannot read --text .*{name} as UTF-8 text"):
            read_texts((str(tmp_path / name),))


def test_task_results_go_into_the_run_or_beside_the_export(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    assert tasks_path(str(tmp_path / "run"), 7) == tmp_path / "run" / "evals" / "tasks-step7.json"
    assert tasks_path(str(tmp_path / "cpu.npz"), 7) == tmp_path / "cpu-tasks-step7.json"
    assert tasks_path(str(tmp_path / "run"), 7, out="x.json") == Path("x.json")


def test_the_validation_line_names_each_source_of_a_mixture() -> None:
    assert format_validation({"loss": 1.23456, "bpb": 0.9, "tokens": 10.0}) == (
        "val loss 1.2346 | val bits/byte 0.9000"
    )
    mixed = {"loss": 1.0, "bpb": 0.5, "loss/web": 2.0, "bpb/web": 0.75}
    assert format_validation(mixed) == "val loss 1.0000 | val bits/byte 0.5000 | bpb/web 0.7500"


def test_without_lm_eval_the_hint_says_how_the_readme_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "minigpt.inference.harness", None)  # as if lm-eval were not installed
    monkeypatch.delattr(minigpt.inference, "harness", raising=False)
    with pytest.raises(ConfigError) as exc:
        import_harness("--tasks")
    assert str(exc.value).startswith("--tasks needs lm-evaluation-harness (")
    assert "pip install -e '.[eval]'" in str(exc.value) and "\n" not in str(exc.value)
