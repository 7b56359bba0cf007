"""lm-eval's own task folder, indexed once per installed version.

Every lm-eval `TaskManager` parses the ~15,000 YAML files lm-eval ships (about 16 s on a laptop core) before it
can name a task; `minigpt eval --tasks`, `train --eval-tasks` and `minigpt lm-eval` each built one per command.
Inside `cached_task_index()`, lm-eval's index of its own folder is read back from minigpt's cache folder (a
pickle of about 16 MB, read in about a second), written there the first time; other folders (your
--include-path) are indexed as before, and override lm-eval's tasks as they would.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from minigpt.runtime import files

log = logging.getLogger(__name__)


def cache_file() -> Path:
    """The index's file, named for lm-eval's version; the folder it indexed is checked inside it."""
    return files.user_cache_dir() / f"lm-eval-{metadata.version('lm_eval')}-task-index.pickle"


def _read(path: Path, folder: Path) -> dict | None:
    """The saved index of `folder`, or None where there is none, or it is of another folder or unreadable."""
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # a torn or foreign file: built again and replaced
        log.warning("lm-eval task index %s is unreadable (%s): indexing the tasks again", path, e)
        return None
    if not isinstance(saved, dict) or saved.get("folder") != str(folder):
        return None
    return saved["index"]


def _index_of(folder: Path, build: Callable[[list[Path]], dict]) -> dict:
    """`folder`'s index as saved, else built by `build` and saved."""
    path = cache_file()
    index = _read(path, folder)
    if index is None:
        index = build([folder])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            files.write_bytes(path, pickle.dumps({"folder": str(folder), "index": index}))
        except Exception as e:  # a read-only cache folder, an index that cannot be pickled: only time is lost
            log.warning("could not save lm-eval's task index to %s (%s)", path, e)
    return index


@contextlib.contextmanager
def cached_task_index() -> Iterator[None]:
    """Within it, a `TaskManager` reads lm-eval's own folder's index from the cache."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    own = Path(lm_eval.tasks.__file__).parent
    saved = vars(TaskIndex)["build"]
    build = saved.__func__

    def cached(paths: Iterable[Path], **kwargs: Any) -> dict:
        index: dict = {}
        for root in paths:  # later folders override earlier ones, as in lm-eval's own build
            mine = Path(root) == own and not kwargs  # its default way of reading the files
            index.update(_index_of(own, build) if mine else build([root], **kwargs))
        return index

    TaskIndex.build = staticmethod(cached)
    try:
        yield
    finally:
        TaskIndex.build = saved
