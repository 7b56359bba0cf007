"""`minigpt check RUN`: whether a run directory's files are still the ones it wrote, before trusting them.

Every checkpoint against its manifest, the source files and token store(s) the run trained on against the
hashes recorded when it did, and the run's own records (config.json, tokenizer/, data.json). Nothing is
written or moved: each problem is one line saying what to do, and the caller exits 1 if there is any.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np

from minigpt.config import ConfigError, TrainConfig, load_json
from minigpt.data.mixture import Corpus, Part
from minigpt.data.saved_tokenizer import load_tokenizer
from minigpt.data.store import TokenStore, files_hashes, sha256_of
from minigpt.training.checkpoint import (
    BASE,
    MANIFEST,
    CheckpointDamaged,
    Checkpointer,
    first_line,
    set_aside,
    verify,
)
from minigpt.training.runs import DATA_FILE, read_data_record, trained_tokenizer


@dataclasses.dataclass
class Findings:
    """What `check_run` found: problems (each a line with what to do), notes, and what verified."""

    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    verified: list[str] = dataclasses.field(default_factory=list)

    def summary(self, run_dir: Path) -> str:
        if self.problems:
            return f"{run_dir}: {len(self.problems)} problem(s); {len(self.verified)} item(s) verified"
        return f"{run_dir}: everything verifies ({', '.join(self.verified) or 'nothing to check'})"


def check_run(run_dir: str | Path) -> Findings:
    """Check a run directory; raises ConfigError only if `run_dir` is no run directory at all."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not ((run_dir / "config.json").exists() or (run_dir / "checkpoints").is_dir()):
        raise ConfigError(f"{run_dir} is not a run directory (no config.json, no checkpoints/)")
    found = Findings()
    _check_checkpoints(run_dir, found)
    cfg = _check_config(run_dir, found)
    if cfg is not None and cfg.model.lora.rank:
        _check_base(run_dir, found)
    tokenizer = _check_tokenizer(run_dir, found)
    recorded = _check_data_record(run_dir, found)
    if recorded is not None:
        _check_sources(run_dir, recorded, found)
        if cfg is not None:
            _check_stores(run_dir, cfg, recorded, tokenizer, found)
    return found


def _check_checkpoints(run_dir: Path, found: Findings) -> None:
    folder = run_dir / "checkpoints"
    steps = (
        sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        if folder.is_dir()
        else []
    )
    good = 0
    for step in steps:
        try:
            if verify(step):
                good += 1
            else:
                found.notes.append(
                    f"checkpoint {step.name} has no {MANIFEST} (written before minigpt recorded one, or killed "
                    "before it was written): its content cannot be checked"
                )
        except CheckpointDamaged as e:
            found.problems.append(
                f"checkpoint {step.name} is damaged ({e}); `minigpt train` sets it aside and resumes from an "
                "older one, `eval`/`generate`/`export` skip it"
            )
    if good:
        found.verified.append(f"{good} checkpoint(s)")
    aside = set_aside(run_dir)
    if aside:
        found.notes.append(f"set aside earlier as damaged: {', '.join(p.name for p in aside)}")
    if not steps:
        found.problems.append(
            f"{run_dir} holds no checkpoint; `minigpt train` with --overwrite (or another --run-dir) starts again"
        )


def _check_base(run_dir: Path, found: Findings) -> None:
    """A LoRA run's base weights (its checkpoints hold the adapters): present and as written."""
    try:
        if not verify(run_dir / BASE):
            raise CheckpointDamaged(f"it has no {MANIFEST}")
        found.verified.append("the base weights")
    except (CheckpointDamaged, OSError) as e:
        found.problems.append(
            f"{BASE}/, the LoRA run's base weights, is damaged or missing ({e}); train the run again with --overwrite"
        )


def _check_config(run_dir: Path, found: Findings) -> TrainConfig | None:
    try:
        cfg = load_json(str(run_dir / "config.json"))
    except (ConfigError, OSError) as e:
        found.problems.append(f"config.json: {e}")
        return None
    if differences := _config_misfits(run_dir, cfg):
        found.problems.append(
            f"config.json does not fit the newest checkpoint ({'; '.join(differences)}): it was edited after "
            "training; put back the values the run was trained with"
        )
        return None
    found.verified.append("config.json")
    return cfg


def _config_misfits(run_dir: Path, cfg: TrainConfig) -> list[str]:
    """How the arrays config.json describes differ from the newest checkpoint's (read from its metadata)."""
    import jax

    from minigpt.training.runs import inference_config
    from minigpt.training.trainer import build, kept

    ckpt = Checkpointer(run_dir, keep=cfg.keep_checkpoints)
    try:
        if not ckpt.steps():
            return []
        abstract = kept(build(inference_config(cfg, len(jax.devices())), optimizer=False).abstract_state)
        return ckpt.other_shapes(max(ckpt.steps()), {"params": abstract.params, "step": abstract.step})
    finally:
        ckpt.close()


def _check_tokenizer(run_dir: Path, found: Findings) -> str | None:
    try:
        identity = load_tokenizer(run_dir / "tokenizer").identity
    except ConfigError as e:  # absent or unreadable, said with the way back
        found.problems.append(f"{e}; `minigpt train` in the run rewrites it from the token store's")
        return None
    trained = trained_tokenizer(run_dir)
    if trained is not None and trained != identity:
        found.problems.append(
            f"the run's tokenizer ({run_dir / 'tokenizer'}) is {identity}, not {trained}, the one its newest "
            "checkpoint was trained with; copy it back from the token store's tokenizer/ folder"
        )
        return None
    found.verified.append("tokenizer")
    return identity


def _check_data_record(run_dir: Path, found: Findings) -> dict | None:
    try:
        recorded = read_data_record(run_dir)
    except ConfigError as e:
        found.problems.append(str(e))
        return None
    if recorded is None:
        found.notes.append(
            f"no {DATA_FILE} (an import, a run older than the record, or deleted): the data it trained on is not "
            "checked; `minigpt train` in the run writes it again"
        )
        return None
    found.verified.append(DATA_FILE)
    return recorded


def _check_sources(run_dir: Path, recorded: dict, found: Findings) -> None:
    """Each recorded source file (hub files aside: pinned) still has the content hash it had."""
    checked = 0
    for f in (f for s in ("train", "val") for f in recorded["sources"][s] if "hub" not in f):
        path = Path(f["path"])
        if not path.is_file():
            found.problems.append(f"source {path} is gone; restore it, or train a new run on other data")
        elif "sha256" in f and sha256_of(path) != f["sha256"]:
            found.problems.append(
                f"source {path} changed since {run_dir} trained on it; restore the original, or train a new "
                "run (--overwrite or another --run-dir)"
            )
        else:
            checked += 1
    if checked:
        found.verified.append(f"{checked} source file(s)")


def _stores(cache_dir: Path) -> list[TokenStore]:
    stores = []
    for meta_path in sorted((cache_dir.expanduser() / "tokens").glob("*/meta.json")):
        try:
            stores.append(TokenStore(meta_path.parent, json.loads(meta_path.read_text())))
        except (OSError, ValueError):
            continue
    return stores


def _run_stores(cfg: TrainConfig, recorded: dict) -> list[TokenStore] | None:
    """The store(s) in the run's cache whose identity is the one data.json recorded (for a mixture: one store
    per named source, combined as `Corpus.identity` combines them); None if none has it."""
    names = [s.name for s in cfg.data.sources()]
    paths = {f["path"] for s in ("train", "val") for f in recorded["sources"][s]}
    candidates = []
    for store in _stores(cfg.data.cache()):
        try:
            if {f["path"] for s in ("train", "val") for f in store.meta["sources"][s]} <= paths:
                candidates.append((store, store.identity))
        except (KeyError, TypeError):
            continue
    if len(candidates) > 8:  # a cache crowded with stores of these files: compare the newest few
        candidates = candidates[-8:]
    for combo in itertools.permutations(candidates, len(names)):
        parts = tuple(Part(n, store, 1.0) for n, (store, _) in zip(names, combo, strict=True))
        if recorded["store_identity"] in (Corpus(parts).identity, Corpus(parts).former_identity):
            return [store for store, _ in combo]
    return None


def _check_stores(
    run_dir: Path, cfg: TrainConfig, recorded: dict, tokenizer: str | None, found: Findings
) -> None:
    stores = _run_stores(cfg, recorded)
    if stores is None:
        found.problems.append(
            f"no token store under {cfg.data.cache_dir} holds the tokens {run_dir} trained on; `minigpt train` "
            "in this run rebuilds it from the sources (if they are unchanged)"
        )
        return
    problems = [(store, _store_problem(store, tokenizer)) for store in stores]
    for store, problem in problems:
        if problem:
            found.problems.append(
                f"token store {store.path}: {problem}; delete the folder and `minigpt prepare` (or `train`) "
                "rebuilds it"
            )
    if not any(problem for _, problem in problems):
        found.verified.append(f"{len(stores)} token store(s)")


def _store_problem(store: TokenStore, tokenizer: str | None) -> str | None:
    """What is wrong with a store's files, or None: its tokenizer files' hashes, its token files' lengths."""
    try:
        if files_hashes(store.path / "tokenizer") != store.meta["tokenizer"]["files"]:
            return "its tokenizer files differ from those its meta.json records"
        if tokenizer is not None and store.tokenizer().identity != tokenizer:
            return "its tokenizer is not the run's"
        itemsize = np.dtype(store.meta["dtype"]).itemsize
        for split, info in store.meta["splits"].items():
            size = (store.path / f"{split}.bin").stat().st_size
            if size < info["tokens"] * itemsize or (
                store.meta.get("complete") and size != info["tokens"] * itemsize
            ):
                return f"{split}.bin holds {size // itemsize:,} tokens, its meta.json says {info['tokens']:,}"
            starts = np.load(store.path / f"{split}.docs.npy", mmap_mode="r")
            if store.meta.get("complete") and len(starts) != info["documents"]:
                return f"{split}.docs.npy lists {len(starts):,} documents, its meta.json says {info['documents']:,}"
            # Stores from before meta.json kept the sha256 are checked by length only.
            recorded = (
                (store.path / f"{split}.bin", info["tokens"] * itemsize),
                store.path / f"{split}.docs.npy",
            )
            if "sha256" in info and sha256_of(*recorded) != info["sha256"]:
                return f"{split}.bin or {split}.docs.npy differs from the sha256 its meta.json records"
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
        return f"unreadable ({first_line(e)})"
    return None
