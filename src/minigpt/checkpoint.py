"""Orbax checkpoints in `run_dir/checkpoints/`: train state (params, optimizer, step, rng), data iterator
state and run metadata, saved asynchronously; restored onto whatever shardings the caller's target carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from minigpt.config import ConfigError


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep: int = 3, async_save: bool = True) -> None:
        self.directory = Path(run_dir).resolve() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        """Start an asynchronous save; the arrays are copied off the devices before this returns."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict, dict]:
        """Restore onto `target`, an abstract state (jax.ShapeDtypeStruct leaves with shardings)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ConfigError(f"no checkpoint in {self.directory}")
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return restored["state"], restored["data"], restored["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
