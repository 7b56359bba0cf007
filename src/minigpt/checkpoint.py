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

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict, dict]:
        """Restore onto `target` (jax.ShapeDtypeStruct leaves with shardings): the newest checkpoint that reads
        back whole, or `step`. A damaged newer one is set aside with a warning, never silently used."""
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        if not candidates:
            raise ConfigError(f"no checkpoint in {self.directory}")
        for s in candidates:
            try:
                restored = self.manager.restore(
                    s,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target),
                        data=ocp.args.JsonRestore(),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as e:  # a truncated or half-deleted checkpoint surfaces as many error types
                if step is not None:
                    raise ConfigError(
                        f"checkpoint {s} in {self.directory} is unreadable: {_first_line(e)}"
                    ) from None
                print(
                    f"warning: checkpoint {s} is damaged ({_first_line(e)}); trying an older one",
                    file=sys.stderr,
                )
                self._set_aside(s)
                continue
            return restored["state"], restored["data"], restored["meta"]
        raise ConfigError(f"no readable checkpoint in {self.directory}; start again with --overwrite")

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
