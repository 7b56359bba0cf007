"""Orbax checkpoints in `run_dir/checkpoints/`, and parameter-only exports.

A checkpoint holds the train state (params, optimizer state, step, rng), the data iterator's position and
run metadata. Saves are asynchronous and atomic (written to a temporary folder, renamed when complete), so
a crash mid-save never damages an earlier checkpoint. Once Orbax has finalized a step, a background thread
records the sha256 of each of its files in a manifest (written last, atomically); a restore checks them before
any array is used, so flipped bytes count as damage, not as weights. Restores go onto whatever shardings the
caller's abstract target carries: a run trained with FSDP on 8 devices resumes on 1, or on a tensor-parallel mesh.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import hashlib
import inspect
import io
import json
import os
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from minigpt.config import ConfigError
from minigpt.parallel import distributed
from minigpt.runtime import files
from minigpt.runtime.errors import CheckpointSaveError


class CheckpointDamaged(ValueError):
    """A checkpoint's files are not the ones its manifest recorded: changed, missing or unreadable."""


MANIFEST = "minigpt_manifest.json"
"""In each step folder: the sha256 of every other file of the step, written once Orbax has finalized it."""


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _digests(paths: list[Path]) -> list[str]:
    """sha256 of each file, one thread per core: hashlib lets go of the GIL while it hashes."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(_sha256, paths))


def _step_files(step_dir: Path) -> list[Path]:
    """Every entry under `step_dir` but folders, the manifest and its temporaries: what a manifest lists."""
    return [
        path
        for path in sorted(step_dir.rglob("*"))
        if (path.is_symlink() or not path.is_dir()) and not path.name.startswith((MANIFEST, f".{MANIFEST}"))
    ]


def _file_digests(step_dir: Path) -> dict[str, str]:
    """sha256 (hex) of every file under `step_dir` by relative path, the manifest and its temporaries aside."""
    paths = [path for path in _step_files(step_dir) if path.is_file()]
    return {path.relative_to(step_dir).as_posix(): d for path, d in zip(paths, _digests(paths), strict=True)}


def write_manifest(step_dir: Path) -> None:
    files.write_json(
        step_dir / MANIFEST, {"version": 1, "algorithm": "sha256", "files": _file_digests(step_dir)}
    )


def _read_manifest(step_dir: Path) -> dict[str, str] | None:
    """The manifest's {relative name: sha256}, checked as the untrusted data it is: a known version and
    algorithm, hex digests, and names of regular files inside the step folder that are all the files it
    holds (so nothing is ever opened outside it, nor a device or FIFO that would never end). None: it has none."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"its manifest is unreadable ({first_line(e)})") from None
    if not isinstance(manifest, dict) or (manifest.get("version"), manifest.get("algorithm")) != (
        1,
        "sha256",
    ):
        raise CheckpointDamaged("its manifest is not a version 1 sha256 manifest, the one minigpt writes")
    recorded = manifest.get("files")
    if not isinstance(recorded, dict) or not all(
        isinstance(d, str) and len(d) == 64 and all(c in "0123456789abcdef" for c in d)
        for d in recorded.values()
    ):
        raise CheckpointDamaged("its manifest's files are not a mapping of names to sha256 digests")
    held = {path.relative_to(step_dir).as_posix(): path for path in _step_files(step_dir)}
    for name in recorded:
        if name not in held:
            raise CheckpointDamaged(f"{name} is missing (recorded in its manifest, not in the step folder)")
    for name, path in held.items():
        if name not in recorded:
            raise CheckpointDamaged(f"{name} is not recorded in its manifest")
        if path.is_symlink() or not path.is_file():
            raise CheckpointDamaged(f"{name} is not a regular file")
    return recorded


def verify(step_dir: Path) -> bool:
    """Whether `step_dir` was checked against its manifest (False: it has none, as a checkpoint written
    before manifests were, or one whose process was killed between finalizing and hashing). Raises
    CheckpointDamaged naming the first file that is missing, unrecorded, not a regular file or differs."""
    recorded = _read_manifest(step_dir)
    if recorded is None:
        return False
    names = list(recorded)
    try:
        found = _digests([step_dir / name for name in names])
    except OSError as e:
        name = os.path.relpath(e.filename, step_dir) if e.filename else "a file"
        raise CheckpointDamaged(f"{name} is unreadable ({e.strerror or first_line(e)})") from None
    for name, digest in zip(names, found, strict=True):
        if digest != recorded[name]:
            raise CheckpointDamaged(f"{name} differs from its recorded sha256")
    return True


def set_aside_name(run_dir: Path, step: int) -> Path:
    """damaged-checkpoint-STEP in `run_dir`, or the first free damaged-checkpoint-STEP.N if that is taken."""
    base = run_dir / f"damaged-checkpoint-{step}"
    name, n = base, 0
    while name.exists():
        n += 1
        name = base.with_name(f"{base.name}.{n}")
    return name


def set_aside(run_dir: Path) -> list[Path]:
    """The checkpoints of `run_dir` that training has set aside as damaged."""
    return sorted(Path(run_dir).glob("damaged-checkpoint-*"))


def nothing_to_resume(run_dir: Path) -> ConfigError:
    """Every checkpoint was set aside: starting at step 0 would train (and log) the same steps again."""
    aside = ", ".join(p.name for p in set_aside(run_dir)) or "none"
    return ConfigError(
        f"every checkpoint of {run_dir} was damaged and set aside ({aside}); rather than start again at step 0: "
        f"pass --overwrite to start again, choose another --run-dir, or see `minigpt check {run_dir}`"
    )


BASE = "base"
"""A LoRA run's frozen base parameters, written once beside its checkpoints (which hold the adapters)."""


def save_base(run_dir: str | Path, params: Any) -> None:
    """Write a LoRA run's frozen parameters to run_dir/base (atomically: Orbax renames a finished save)."""
    path = Path(run_dir).resolve() / BASE
    saver = ocp.StandardCheckpointer()
    saver.save(path, params, force=True)
    saver.wait_until_finished()
    saver.close()
    if jax.process_index() == 0:
        write_manifest(path)


def restore_base(run_dir: str | Path, target: Any) -> Any:
    """A LoRA run's frozen parameters onto `target`'s shardings, checked against their manifest."""
    path = Path(run_dir).resolve() / BASE
    if not path.is_dir():
        raise ConfigError(
            f"{path} is missing: a LoRA run's checkpoints hold its adapters, and its base weights are kept there; "
            "train it again with --overwrite"
        )
    try:
        verify(path)
        return ocp.StandardCheckpointer().restore(path, target)
    except Exception as e:
        raise ConfigError(
            f"{path} cannot be read ({first_line(e)}); train the run again with --overwrite"
        ) from None


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
        self._hashing: threading.Thread | None = None
        self._hash_error: Exception | None = None
        self._vouched: set[int] = set()  # steps this process saved, or verified against their manifest

    def vouched(self, step: int) -> bool:
        """Whether `step` is known to be good: saved by this process, or restored after its files matched its
        manifest (not one restored without a manifest, which may be damaged)."""
        return step in self._vouched

    def kept(self) -> str:
        """What a run that stops on an error leaves to go back to, in a sentence: the newest checkpoint, called
        good only where it is known to be."""
        last, where = self.latest_step(), self.directory
        if last is None:
            return "No checkpoint was saved before it"
        if self.vouched(last):
            return f"The last good checkpoint (step {last}) is kept in {where}"
        return (
            f"The newest checkpoint (step {last}, in {where}), which the run resumed from, has no manifest to "
            f"verify it against and may be damaged: `minigpt check {where.parent}`"
        )

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self, step: int, state: Any, data_state: dict, meta: dict, val_loss: float | None = None
    ) -> None:
        """Start an asynchronous save; the arrays are copied off the devices before this returns.
        A failure of this save or of the previous one (surfacing late, as saves are asynchronous) is raised.
        The step's manifest is written in the background once Orbax has finalized it (process 0 only)."""
        with self._failures(step):
            self._join_hashing()
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
        self._vouched.add(step)
        if jax.process_index() == 0:
            self._hashing = threading.Thread(
                target=self._hash_when_final, args=(step,), name="minigpt-manifest"
            )
            self._hashing.start()

    def _hash_when_final(self, step: int) -> None:
        """Wait for Orbax to finalize `step`, then write its manifest. A failed save writes none (its error
        reaches the training loop through the manager); a failed manifest is raised at the next save."""
        try:
            self.manager.wait_until_finished()
        except Exception:
            return
        step_dir = self.directory / str(step)
        try:
            if step_dir.is_dir():
                write_manifest(step_dir)
        except Exception as e:
            self._hash_error = e

    def _join_hashing(self) -> None:
        if self._hashing is not None:
            self._hashing.join()
            self._hashing = None
        error, self._hash_error = self._hash_error, None
        if error is not None:
            raise error

    @contextlib.contextmanager
    def _failures(self, step: int | None = None) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            kept = [s for s in self.steps() if step is None or s < step]
            raise CheckpointSaveError(
                f"saving {'the last checkpoint' if step is None else f'the checkpoint at step {step}'} failed "
                f"({first_line(e)}); "
                f"earlier checkpoints are intact (newest: {max(kept) if kept else 'none'} in {self.directory})"
            ) from e

    def restore(
        self, target: Any, set_aside: bool = True, optional: dict[str, Any] | None = None
    ) -> tuple[Any, dict, dict]:
        """Restore onto `target` (jax.ShapeDtypeStruct leaves with shardings) the newest checkpoint that
        verifies against its manifest and reads back whole. A damaged one (changed bytes, unreadable,
        truncated) is skipped with a warning and, if `set_aside` (training, which will write new ones), moved
        to damaged-checkpoint-STEP; read-only commands move nothing. A readable checkpoint of another shape
        than `target` (the config changed) is refused with the differences, and nothing is moved.

        `target` a dict, `optional` names further entries (with their abstract values) read where the
        checkpoint holds them, and left out of the result where it does not."""

        def read(step: int) -> Any:
            part = target
            if optional:
                held = {k.split(".")[0] for k in self._saved_shapes(step)}
                part = {**target, **{k: v for k, v in optional.items() if k in held}}
            return self.manager.restore(step, args=self._restore_args(part))

        restored = self._newest(read, target, set_aside)
        return restored["state"], restored["data"], restored["meta"]

    def restore_params(self, target: Any) -> tuple[Any, int]:
        """The parameters and step of the newest good checkpoint (as `restore`, moving nothing), onto the
        params of `target` (an abstract train state): what generate and eval need, without reading the
        optimizer state, which under Adam is twice the parameters' size."""
        part = {"params": target.params, "step": target.step}
        args = ocp.args.PyTreeRestore(
            item=part, restore_args=ocp.checkpoint_utils.construct_restore_args(part), partial_restore=True
        )
        read = ocp.PyTreeCheckpointer()

        def read_params(step: int) -> Any:
            self._refuse_other_shapes(step, part)  # a partial restore leaves arrays it lacks unread, silently
            return read.restore(self.directory / str(step) / "state", args=args)

        restored = self._newest(read_params, part, False)
        return restored["params"], int(restored["step"])

    def _newest(self, read: Callable[[int], Any], target: Any, set_aside: bool) -> Any:
        """`read(step)` of the newest step that verifies and reads back; the shapes are compared only when a
        read fails, to tell a changed config (refused) from damage (skipped)."""
        candidates = sorted(self.steps(), reverse=True)
        if not candidates:
            raise ConfigError(f"no checkpoint in {self.directory}; train one with `minigpt train`")
        for s in candidates:
            try:
                self._verify(s)
                return read(s)
            except Exception as e:  # a truncated or half-deleted checkpoint surfaces as many error types
                close_abandoned_reads()
                if not isinstance(e, CheckpointDamaged):
                    self._refuse_other_shapes(s, target)
                self._damaged(s, e, set_aside)
        if set_aside:
            raise nothing_to_resume(self.directory.parent)
        raise ConfigError(
            f"no readable checkpoint in {self.directory}; see `minigpt check {self.directory.parent}`"
        )

    def other_shapes(self, step: int, target: Any) -> list[str]:
        """How step's arrays (those `target` names) differ from `target`'s in shape or presence: [] when they
        fit, or when the checkpoint's metadata is unreadable (damage, which a read reports)."""
        try:
            saved = self._saved_shapes(step)
        except Exception:
            return []
        wanted = _shapes(target)
        tops = {k.split(".")[0] for k in wanted}
        return _shape_differences({k: v for k, v in saved.items() if k.split(".")[0] in tops}, wanted)

    def _refuse_other_shapes(self, step: int, target: Any) -> None:
        """A ConfigError naming the differences if step's arrays (those `target` names) have other shapes."""
        if differences := self.other_shapes(step, target):
            raise ConfigError(
                f"checkpoint {step} in {self.directory} does not fit this config ({'; '.join(differences)}); "
                "use the config it was trained with (the run's config.json), or --overwrite / another --run-dir"
            )

    def _verify(self, step: int) -> None:
        """Process 0 checks the step's files against its manifest and every process takes its verdict, so all
        skip the same checkpoints. One without a manifest is used, with a note."""
        damage: CheckpointDamaged | None = None
        verified = True
        if jax.process_index() == 0:
            try:
                verified = verify(self.directory / str(step))
            except CheckpointDamaged as e:
                damage = e
        if distributed.any_process(damage is not None):
            raise damage or CheckpointDamaged("process 0 found it damaged")
        if verified:
            self._vouched.add(step)
        else:
            print(
                f"note: checkpoint {step} has no manifest (written before minigpt recorded one, or killed before "
                "its manifest was written); restoring it without checking its content",
                file=sys.stderr,
            )

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

    def _damaged(self, step: int, error: Exception, move: bool) -> None:
        """Warn (process 0) and, if `move`, set the step aside under a name no earlier one has taken."""
        aside = set_aside_name(self.directory.parent, step)
        where = f"set aside as {aside.name}" if move else "left in place"
        if jax.process_index() == 0:
            print(
                f"warning: checkpoint {step} is damaged ({first_line(error)}); {where}, trying an older one",
                file=sys.stderr,
            )
            if move and (self.directory / str(step)).exists():
                (self.directory / str(step)).rename(aside)
        if move:
            self.manager.reload()

    def close(self) -> None:
        """Wait for in-flight saves to land, then release the manager."""
        with self._failures():
            self.manager.wait_until_finished()
            self._join_hashing()
        self.manager.close()


def close_abandoned_reads() -> None:
    """Close the reads of a restore that failed half way (an array of another shape, a damaged file). Orbax
    leaves the reads of its other arrays suspended in an event loop it has closed, and turns the GeneratorExit
    that closing one throws into an Exception; left to the collector (at exit at the latest), each is printed
    as 'Exception ignored in: <coroutine object _read_array_index_and_device_put ...>' with a page of
    TensorStore's spec, under the command's one-line error."""
    for obj in gc.get_objects():
        if (
            inspect.iscoroutine(obj)
            and obj.cr_frame is not None
            and obj.cr_code.co_name == "_read_array_index_and_device_put"
            and obj.cr_code.co_filename.startswith(os.path.dirname(ocp.__file__))
        ):
            with contextlib.suppress(BaseException):
                obj.close()


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


def first_line(e: Exception) -> str:
    """An error's first line (at most 200 characters), for a one-line message."""
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
    tokenizer = {
        f"tokenizer/{f.name}": np.frombuffer(f.read_bytes(), np.uint8) for f in tokenizer_dir.iterdir()
    }
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with files.atomic_open(path, "wb") as f:  # a failure leaves no temporary behind
            np.savez(
                f,
                **{f"params/{k}": v for k, v in flat.items()},
                config=np.frombuffer(json.dumps(config).encode(), np.uint8),
                **tokenizer,
            )
    except OSError as e:  # a full disk inside the zip writer names no file: name the export
        raise OSError(e.errno, e.strerror or first_line(e), str(path)) from None


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
        raise ConfigError(f"{path} is not a minigpt export ({first_line(e)})") from None
    with z:
        if "config" not in z:
            raise ConfigError(f"{path} is not a minigpt export (no config)")
        config = json.load(io.BytesIO(z["config"].tobytes()))
        folder = Path(tempfile.mkdtemp(prefix="minigpt-tokenizer-"))
        for name in z.files:
            if name.startswith("tokenizer/"):
                (folder / name.split("/", 1)[1]).write_bytes(z[name].tobytes())
    return config, folder
