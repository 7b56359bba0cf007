"""lm-eval's own task folder indexed once per version: read back from minigpt's cache folder by every
TaskManager, your own folders indexed as before and overriding it."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import lm_eval.tasks
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import Entry, Kind, TaskIndex

from minigpt.inference import task_index

OWN = Path(lm_eval.tasks.__file__).parent
TASK_YAML = "task: {name}\ndataset_path: json\noutput_type: loglikelihood\ndoc_to_text: x\ndoc_to_target: y\n"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _save(index: dict, folder: Path = OWN) -> None:
    path = task_index.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"folder": str(folder), "index": index}))


def _entry(name: str) -> Entry:
    return Entry(name=name, kind=Kind.TASK, yaml_path=None, cfg={"task": name})


def test_a_task_manager_reads_lm_evals_own_index_from_the_cache_and_your_folder_as_before(
    tmp_path: Path,
) -> None:
    """The saved index stands for lm-eval's 15,000 files (so this test parses none of them); a folder of your
    own is indexed, and its task of the same name overrides the saved one."""
    _save({"saved_only": _entry("saved_only"), "both": _entry("both")})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "both.yaml").write_text(TASK_YAML.format(name="both"))
    with task_index.cached_task_index():
        manager = TaskManager(include_path=str(mine))
    assert manager.all_tasks == ["both", "saved_only"]
    assert manager._index["both"].yaml_path == mine / "both.yaml"
    assert "cached" not in repr(vars(TaskIndex)["build"].__func__)  # lm-eval's own build is back


def test_the_index_is_built_once_and_a_torn_or_foreign_file_is_built_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    built = []

    def build(paths: list[Path]) -> dict:
        built.append(paths)
        return {"t": _entry("t")}

    assert task_index._index_of(OWN, build) == {"t": _entry("t")}
    assert task_index._index_of(OWN, build) == {"t": _entry("t")} and built == [[OWN]]  # read back
    task_index.cache_file().write_bytes(b"\x80\x04torn")
    with caplog.at_level(logging.WARNING):
        task_index._index_of(OWN, build)
    assert len(built) == 2 and "unreadable" in caplog.text
    _save({"u": _entry("u")}, folder=Path("/another/lm_eval/tasks"))
    assert task_index._index_of(OWN, build) == {"t": _entry("t")} and len(built) == 3


def test_lm_evals_build_is_restored_when_the_manager_fails() -> None:
    saved = vars(TaskIndex)["build"]
    with pytest.raises(RuntimeError), task_index.cached_task_index():
        raise RuntimeError("a task manager failed")
    assert vars(TaskIndex)["build"] is saved


def test_a_saved_index_of_real_task_files_reads_back_as_lm_eval_builds_it() -> None:
    """lm-eval's MMLU folder (groups, tags, tasks with includes) stands for its whole folder, which takes
    10-16 s to parse: its entries survive saving and reading back exactly."""
    folder = OWN / "mmlu"
    built = task_index._index_of(folder, TaskIndex.build)
    assert task_index.cache_file().exists()
    again = task_index._index_of(folder, lambda paths: pytest.fail("read back, not built again"))
    assert again == built == TaskIndex.build([folder])
    assert {entry.kind for entry in again.values()} == {Kind.GROUP, Kind.TAG, Kind.TASK} and len(again) > 60
