"""Orbax checkpoints in `run_dir/checkpoints/`, and parameter-only exports.

A checkpoint holds the train state (params, optimizer state, step, rng), the data iterator's position and
run metadata. Saves are asynchronous and atomic (written to a temporary folder, renamed when complete), so
a crash mid-save never damages an earlier checkpoint. Restores go onto whatever shardings the caller's
abstract target carries: a run trained with FSDP on 8 devices resumes on 1, or on a tensor-parallel mesh.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from minigpt.config import ConfigError


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions); the earlier checkpoints are untouched."""


class Checkpointer:
    """Keeps the newest `keep` checkpoints plus the one with the best validation loss."""

    def __init__(self, run_dir: str | Path, keep: int = 3, async_save: bool = True) -> None:
        self.directory = Path(run_dir).resolve() / "checkpoints"
        policy = pp.AnyPreservationPolicy(
            [
                pp.LatestN(n=keep),
                pp.BestN(
                    get_metric_fn=lambda m: m["val_loss"],
                    reverse=True,
                    n=1,
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        )
        options = ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=async_save, preservation_policy=policy
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self, step: int, state: Any, data_state: dict, meta: dict, val_loss: float | None = None
    ) -> None:
        """Start an asynchronous save; the arrays are copied off the devices before this returns.
        A failure of this save or of the previous one (surfacing late, as saves are asynchronous) is raised."""
        with self._failures(step):
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(data_state),
                    meta=ocp.args.JsonSave(meta),
                ),
                metrics={"val_loss": val_loss} if val_loss is not None else None,
                force=True,
            )

    @contextlib.contextmanager
    def _failures(self, step: int | None = None) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            kept = [s for s in self.steps() if step is None or s < step]
            raise CheckpointSaveError(
                f"saving {'the last checkpoint' if step is None else f'the checkpoint at step {step}'} failed "
                f"({_first_line(e)}); "
                f"earlier checkpoints are intact (newest: {max(kept) if kept else 'none'} in {self.directory})"
            ) from e

    def restore(self, target: Any, set_aside: bool = True) -> tuple[Any, dict, dict]:
        """Restore onto `target` (jax.ShapeDtypeStruct leaves with shardings) the newest checkpoint that reads
        back whole. A damaged one (unreadable, truncated) is skipped with a warning and, if `set_aside`
        (training, which will write new ones), moved to damaged-checkpoint-STEP; read-only commands move
        nothing. A readable checkpoint of another shape than `target` (the config changed) is refused with
        the differences, and nothing is moved."""
        candidates = sorted(self.steps(), reverse=True)
        if not candidates:
            raise ConfigError(f"no checkpoint in {self.directory}; train one with `minigpt train`")
        for s in candidates:
            try:
                saved = self._saved_shapes(s)
            except Exception as e:  # a truncated or half-deleted checkpoint surfaces as many error types
                self._damaged(s, e, set_aside)
                continue
            differences = _shape_differences(saved, _shapes(target))
            if differences:
                raise ConfigError(
                    f"checkpoint {s} in {self.directory} does not fit this config ({'; '.join(differences)}); "
                    "use the config it was trained with (the run's config.json), or --overwrite / another --run-dir"
                )
            try:
                restored = self.manager.restore(s, args=self._restore_args(target))
            except Exception as e:
                self._damaged(s, e, set_aside)
                continue
            return restored["state"], restored["data"], restored["meta"]
        raise ConfigError(f"no readable checkpoint in {self.directory}; start again with --overwrite")

    def _restore_args(self, target: Any) -> ocp.args.Composite:
        return ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()
        )

    def _saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        """Each array's shape as the checkpoint's own metadata records it (reads no array data)."""
        metadata = ocp.StandardCheckpointer().metadata(self.directory / str(step) / "state")
        shapes = _shapes(metadata.item_metadata)
        if not shapes:  # the tree's metadata is missing or unreadable: damage, not another model
            raise ValueError("the checkpoint's array metadata is unreadable")
        return shapes

    def _damaged(self, step: int, error: Exception, set_aside: bool) -> None:
        where = f"set aside as damaged-checkpoint-{step}" if set_aside else "left in place"
        print(
            f"warning: checkpoint {step} is damaged ({_first_line(error)}); {where}, trying an older one",
            file=sys.stderr,
        )
        if set_aside:
            self._set_aside(step)

    def _set_aside(self, step: int) -> None:
        if jax.process_index() == 0:
            src = self.directory / str(step)
            if src.exists():
                src.rename(self.directory.parent / f"damaged-checkpoint-{step}")
        self.manager.reload()

    def close(self) -> None:
        """Wait for in-flight saves to land, then release the manager."""
        with self._failures():
            self.manager.wait_until_finished()
        self.manager.close()


def _key_name(path: tuple) -> str:
    """A key path as dotted names, the same for a live state ('.params', ['blocks'], [0], '.value') and the
    nested dicts and lists a checkpoint's metadata holds."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {
        _key_name(p): tuple(getattr(x, "shape", ())) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def _shape_differences(saved: dict[str, tuple], wanted: dict[str, tuple], limit: int = 4) -> list[str]:
    """'name: saved shape -> wanted shape' for arrays that differ, are missing or are new (the first few)."""
    names = sorted(saved.keys() | wanted.keys(), key=lambda k: (not k.startswith("params."), k))
    out = [
        f"{k.removesuffix('.value')}: {saved.get(k, 'absent')} -> {wanted.get(k, 'absent')}"
        for k in names
        if saved.get(k) != wanted.get(k)
    ]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def write_export(path: str | Path, params: Any, config: dict, tokenizer_dir: Path) -> None:
    """One .npz file with the parameters (keyed by their path), the run config and the tokenizer files: all
    that `generate` and `eval` need, nothing for resuming training. Gathers from any mesh; process 0 writes."""
    from jax.experimental import multihost_utils

    flat = {
        jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
        for p, x in jax.tree_util.tree_leaves_with_path(params)
    }
    if jax.process_index() != 0:
        return
    files = {f"tokenizer/{f.name}": np.frombuffer(f.read_bytes(), np.uint8) for f in tokenizer_dir.iterdir()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        **{f"params/{k}": v for k, v in flat.items()},
        config=np.frombuffer(json.dumps(config).encode(), np.uint8),
        **files,
    )
    tmp.rename(path)


def read_export(path: str | Path, abstract_params: Any) -> Any:
    """Parameters of an export, in the structure of `abstract_params` (checked leaf by leaf)."""
    with np.load(path) as z:

        def one(p, leaf):
            key = f"params/{jax.tree_util.keystr(p)}"
            if key not in z:
                raise ConfigError(
                    f"{path} has no parameter {jax.tree_util.keystr(p)}: not an export of this model"
                )
            value = z[key]
            if value.shape != leaf.shape:
                raise ConfigError(
                    f"{path}: {jax.tree_util.keystr(p)} has shape {value.shape}, expected {leaf.shape}"
                )
            return jax.device_put(value, leaf.sharding) if getattr(leaf, "sharding", None) else value

        return jax.tree_util.tree_map_with_path(one, abstract_params)


def export_config_and_tokenizer(path: str | Path) -> tuple[dict, Path]:
    """The config dict of an export and a temporary folder holding its tokenizer files."""
    try:
        z = np.load(path)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{path} is not a minigpt export ({_first_line(e)})") from None
    with z:
        if "config" not in z:
            raise ConfigError(f"{path} is not a minigpt export (no config)")
        config = json.load(io.BytesIO(z["config"].tobytes()))
        folder = Path(tempfile.mkdtemp(prefix="minigpt-tokenizer-"))
        for name in z.files:
            if name.startswith("tokenizer/"):
                (folder / name.split("/", 1)[1]).write_bytes(z[name].tobytes())
    return config, folder
