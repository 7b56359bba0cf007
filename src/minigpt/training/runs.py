"""A trained run wherever it lives: a run directory (config.json, tokenizer/, checkpoints/) or a one-file
export. Reading its config, loading its model for inference, writing exports, and refusing a tokenizer that
is not the model's own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt.config import (
    ConfigError,
    DataConfig,
    LoRAConfig,
    ModelConfig,
    TrainConfig,
    from_dict,
    load_json,
    to_dict,
)
from minigpt.data.mixture import Corpus
from minigpt.data.saved_tokenizer import load_tokenizer
from minigpt.data.store import sha256_of
from minigpt.data.tokenizer import Tokenizer
from minigpt.nn import lora
from minigpt.nn.model import abstract_model
from minigpt.runtime import files
from minigpt.training.checkpoint import (
    Checkpointer,
    export_config_and_tokenizer,
    first_line,
    read_export,
    restore_base,
    write_export,
)
from minigpt.training.trainer import Setup, build, kept, trained


def _not_a_run(path: Path) -> ConfigError:
    return ConfigError(
        f"{path} is neither a run directory (no config.json) nor an export; train with `minigpt train`"
    )


def _is_transformers_folder(path: Path) -> bool:
    """A transformers checkpoint folder (as `minigpt export --format hf` writes): safetensors weights, or a
    config.json that names transformers classes."""
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return True
    try:
        config = json.loads((path / "config.json").read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ("architectures" in config or "model_type" in config)


def _open_run(path: Path) -> tuple[TrainConfig, Path, int]:
    """(config, tokenizer folder, the export's step: 0 for a run directory) of a run directory or an export
    file; an export's tokenizer folder is a temporary copy."""
    if path.is_file():
        config, folder = export_config_and_tokenizer(path)
        step = config.pop("step", 0) if isinstance(config, dict) else 0
        try:
            return from_dict(config), folder, int(step)
        except (ConfigError, TypeError, ValueError) as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise ConfigError(
                f"{path} holds a config that is not a readable minigpt config ({e}); export the run again "
                "with `minigpt export --run RUN --out FILE`"
            ) from None
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError(
            f"{path} cannot be read by you (Permission denied); ask its owner, or copy it readable"
        )
    if _is_transformers_folder(path):
        raise ConfigError(
            f"{path} is a transformers checkpoint folder, not a minigpt run; import it with "
            f"`minigpt import --hf {path} --out RUN`, then pass --run RUN"
        )
    if (path / "config.json").is_file():
        return load_json(str(path / "config.json")), path / "tokenizer", 0
    raise _not_a_run(path)


def run_config(path: str | Path) -> TrainConfig:
    """A run directory's (or export file's) config, read before any weights."""
    path = Path(path)
    cfg, folder, _ = _open_run(path)
    if path.is_file():
        shutil.rmtree(folder, ignore_errors=True)
    return cfg


def run_tokenizer(path: str | Path) -> Tokenizer:
    """A run directory's (or export file's) tokenizer, read without the model."""
    path = Path(path)
    _, folder, _ = _open_run(path)
    try:
        return load_tokenizer(folder)
    finally:
        if path.is_file():
            shutil.rmtree(folder, ignore_errors=True)


def inference_config(cfg: TrainConfig, n_devices: int, tensor: int = 1) -> TrainConfig:
    """Inference splits the model over `tensor` devices and uses the rest for data parallelism; any batch
    that the data-parallel size divides will do."""
    if tensor < 1 or n_devices % tensor:
        raise ConfigError(f"tensor={tensor} must be >= 1 and divide the {n_devices} devices")
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, data=-1, fsdp=1, tensor=tensor),
        batch_size=math.lcm(cfg.batch_size, n_devices // tensor),
    )


def load_model(
    path: str | Path, devices: list | None = None, tensor: int = 1
) -> tuple[Setup, Any, Tokenizer, int]:
    """(setup, params, tokenizer, step) of a run directory (newest checkpoint) or of an export file, on a
    mesh of every device: `tensor`-way tensor parallel, data parallel over the rest."""
    path = Path(path)
    cfg, tok_dir, step = _open_run(path)
    tokenizer = load_tokenizer(tok_dir)
    if path.is_dir():
        _check_run_tokenizer(path, tok_dir, tokenizer)
    n_devices = len(devices if devices is not None else jax.devices())
    setup = build(inference_config(cfg, n_devices, tensor), devices, optimizer=False)
    if path.is_file():
        params = read_export(path, setup.abstract_state.params)
    else:
        ckpt = Checkpointer(path, keep=cfg.keep_checkpoints)
        params, step = ckpt.restore_params(kept(setup.abstract_state))
        ckpt.close()
        if (base := trained(setup.abstract_state.params)[1]) is not None:
            params = lora.merge(params, restore_base(path, base))
    return setup, params, tokenizer, step


def _check_run_tokenizer(run_dir: Path, tok_dir: Path, tokenizer: Tokenizer) -> None:
    """Refuse a run directory's tokenizer that is not the one its newest checkpoint was trained with (edited,
    or copied from another run): sampled or scored, its token ids would mean other text."""
    made = trained_tokenizer(run_dir)
    if made is not None and made != tokenizer.identity:
        raise ConfigError(
            f"the run's tokenizer ({tok_dir}) is {tokenizer.identity}, not {made}, the one its newest checkpoint "
            "was trained with, so its token ids would mean other text; copy it back from the token store's "
            "tokenizer/ folder (`minigpt check` names the store)"
        )


def folded(cfg: ModelConfig, params: Any) -> tuple[nnx.GraphDef, Any]:
    """A LoRA model as a plain one: its graph without adapters, and its parameters with each adapter folded
    into its projection (W + alpha / rank * A @ B), so serving it costs what the base model costs. A model
    without adapters comes back as it is."""
    plain = dataclasses.replace(cfg, lora=LoRAConfig())
    graphdef, abstract = abstract_model(plain)
    scale = cfg.lora.alpha / cfg.lora.rank if cfg.lora.rank else 0.0

    def fold(tree: Any) -> Any:
        if not isinstance(tree, dict):
            return tree
        if "adapter" in tree and "kernel" in tree:
            pair = tree["adapter"]["lora"]
            ab = jnp.matmul(pair["lora_a"], pair["lora_b"], precision=jax.lax.Precision.HIGHEST)
            tree = {k: v for k, v in tree.items() if k != "adapter"} | {"kernel": tree["kernel"] + scale * ab}
        return {k: fold(v) for k, v in tree.items()}

    nnx.replace_by_pure_dict(abstract, fold(nnx.to_pure_dict(params)))
    return graphdef, abstract


def export(run_dir: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the newest checkpoint's parameters, config and tokenizer to one file."""
    out = Path(out)
    check_output(out, Path(run_dir), overwrite, "file")
    setup, params, _, step = load_model(run_dir)
    write_export(out, params, {**to_dict(setup.cfg), "step": step}, Path(run_dir) / "tokenizer")
    return out


def check_tokenizer(saved_dir: Path, identity: str, trained: str | None = None) -> None:
    """Refuse to train or evaluate a model with a tokenizer other than the one it was trained (or imported)
    with: the token ids would mean different text. A saved tokenizer that no longer reads is let through
    when `trained`, the identity the run's checkpoints recorded, is the data's: training rewrites it."""
    if not (saved_dir / "minigpt_tokenizer.json").is_file():
        return
    try:
        saved = load_tokenizer(saved_dir).identity
    except ConfigError as e:
        if trained != identity:
            raise
        print(f"note: {e}; rewriting it from the token store's, the one its checkpoints recorded ({trained})")
        return
    if saved != identity:
        raise ConfigError(
            f"the model's tokenizer ({saved}, in {saved_dir}) differs from the one the data was tokenized with "
            f"({identity}); minigpt tokenizes corpora only with GPT-2's BPE or a BPE it trains itself"
        )


def trained_tokenizer(run_dir: Path) -> str | None:
    """The tokenizer identity the newest checkpoint recorded when it was saved (None if unreadable)."""
    steps = sorted(
        (p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()), key=lambda p: int(p.name)
    )
    try:
        return json.loads((steps[-1] / "meta" / "metadata").read_text())["tokenizer"]
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        return None


DATA_FILE = "data.json"
"""In a run directory: the identity of the token store it trained on, its source files, and the extent it
reads (tokens per split of each source)."""


def record_data(run_dir: Path, corpus: Corpus) -> None:
    keep = ("path", "size", "mtime_ns", "sha256", "hub")
    sources = {
        s: [{k: f[k] for k in keep if k in f} for f in corpus.source_files(s)] for s in ("train", "val")
    }
    record = {"store_identity": corpus.identity, "sources": sources, "extent": corpus.extent()}
    files.write_json(run_dir / DATA_FILE, record)


def recorded_extent(run_dir: Path) -> dict[str, dict[str, int]] | None:
    """The extent a run reads (see `Corpus.extent`), to resume it on the same windows however far its stores
    were extended since; None for a new run. A run recorded before extents were read whole splits: {}."""
    saved = read_data_record(run_dir)
    if saved is None:
        return None
    extent = saved.get("extent", {})
    if not isinstance(extent, dict) or not all(
        isinstance(e, dict) and all(isinstance(e.get(s), int) for s in ("train", "val"))
        for e in extent.values()
    ):
        raise ConfigError(f"{Path(run_dir) / DATA_FILE} is unreadable (a bad extent); restore it or retrain")
    return extent


def read_data_record(run_dir: Path) -> dict | None:
    """data.json, checked to be the record minigpt writes (a store identity and each split's source files);
    None where there is none (an export, an import, or a run from before this record was kept)."""
    path = Path(run_dir) / DATA_FILE
    try:
        saved = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({first_line(e)}); restore it or retrain") from None
    sources = saved.get("sources") if isinstance(saved, dict) else None
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("store_identity"), str)
        and isinstance(sources, dict)
        and all(isinstance(sources.get(s), list) for s in ("train", "val"))
        and all(
            isinstance(f, dict) and ("hub" in f or "path" in f) for s in ("train", "val") for f in sources[s]
        )
    ):
        raise ConfigError(
            f"{path} is unreadable (not the record of a run's data minigpt writes); restore it or retrain"
        )
    return saved


def _changed(run_dir: Path, what: str) -> ConfigError:
    return ConfigError(
        f"the data {run_dir} was trained on has changed since: {what}. Restore the original files, or train "
        "a new run (--overwrite or another --run-dir)"
    )


def check_sources(run_dir: Path, data: DataConfig | None = None) -> None:
    """Before any tokenizing: refuse to resume or evaluate a run whose source files changed since it trained
    (a file's content hash is computed only when its size or modification time moved; a file its paused
    store had not read then has none, and was not read by the run), or, given the `data` it is resumed with,
    whose mixture gained or lost a source."""
    saved = read_data_record(run_dir)
    if saved is not None and data is not None:
        _check_source_names(run_dir, set(saved.get("extent", {})), {s.name for s in data.sources()})
    for f in [] if saved is None else [f for s in ("train", "val") for f in saved["sources"][s]]:
        if "hub" in f:
            continue  # a hub dataset's file at a pinned commit: it cannot change, nor need it stay in the cache
        path = Path(f["path"])
        try:
            st = path.stat()
        except OSError:
            raise _changed(run_dir, f"{path} is gone") from None
        moved = (st.st_size, st.st_mtime_ns) != (f["size"], f["mtime_ns"])
        if moved and "sha256" in f and sha256_of(path) != f["sha256"]:
            raise _changed(run_dir, f"{path} was edited or replaced")


def _check_source_names(run_dir: Path, before: set[str], now: set[str]) -> None:
    """Named before tokenizing: a source left out would otherwise show up later as another tokenizer (a BPE
    trained on other text) or a store shorter than the run read."""
    if not before or before == now:  # an empty record: a run from before sources were recorded
        return
    name = lambda n: repr(n) if n else "the unnamed corpus"
    what = [f"{verb} {', '.join(map(name, sorted(names)))}" for verb, names in (("drops", before - now),
            ("adds", now - before)) if names]  # fmt: skip
    raise ConfigError(
        f"{run_dir} trained on the sources {', '.join(map(name, sorted(before)))}, and this --data "
        f"{' and '.join(what)}; resume it with the same --data, pass --overwrite to start it again on these "
        "sources, or choose another --run-dir"
    )


def check_data(run_dir: Path, corpus: Corpus) -> None:
    """After tokenizing: the token stores must be the ones the run trained on (same sources, tokenizer and
    reading options), wherever they are."""
    saved = read_data_record(run_dir)
    if saved is not None and saved.get("store_identity") not in (corpus.identity, corpus.former_identity):
        raise _changed(
            run_dir, "its token store now holds other tokens (other files, reading options or chat template)"
        )


def is_training_run(path: Path) -> bool:
    """A run directory that training wrote into (metrics, or checkpoints past the step 0 an import writes):
    never an export's or import's target."""
    if (path / "metrics.jsonl").exists():
        return True
    ckpts = path / "checkpoints"
    return ckpts.is_dir() and any(s.name.isdigit() and s.name != "0" for s in ckpts.iterdir())


def check_output(out: Path, source: Path | None, overwrite: bool, kind: str) -> None:
    """Refuse, before anything is read or written, an export or import target that would destroy work: its own
    source (or a folder holding it, or inside it), a training run directory, or an existing path without
    --overwrite. `kind` is what `out` will be: "file", "transformers checkpoint folder" or "run directory"."""
    out_r, src_r = out.resolve(), source.resolve() if source is not None else None
    if src_r is not None and (out_r == src_r or src_r.is_relative_to(out_r) or out_r.is_relative_to(src_r)):
        raise ConfigError(f"--out {out} would overwrite its own source {source}; choose another --out")
    if not out.exists():
        return
    if is_training_run(out):
        raise ConfigError(f"{out} is a training run directory; minigpt never writes a {kind} over one")
    if not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")
    if kind == "file" and out.is_dir():
        raise ConfigError(f"{out} is a folder, not a file; not replacing it")
    if kind != "file" and (out.is_file() or (any(out.iterdir()) and not (out / "config.json").is_file())):
        raise ConfigError(f"{out} is not a {kind} (no config.json); not replacing it")
