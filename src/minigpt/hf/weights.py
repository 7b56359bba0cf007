"""The safetensors reader: a transformers checkpoint folder's weights as numpy arrays, bfloat16 included.

safetensors.numpy cannot read bfloat16 (numpy has no such dtype), and many checkpoints are bfloat16, so the
file format (an 8-byte header length, a JSON header, then the raw tensors) is read here; a torn or damaged
file is a one-line ConfigError rather than a numpy traceback.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from minigpt.config import ConfigError

_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors file as numpy arrays, bfloat16 included (numpy has no bfloat16, so
    safetensors.numpy cannot read it); float tensors are returned as float32 (exactly)."""
    import ml_dtypes

    dtypes = {**_SAFETENSORS_DTYPES, "BF16": ml_dtypes.bfloat16}
    raw = path.read_bytes()
    try:
        header, base = _safetensors_header(raw)
    except ValueError as e:
        raise ConfigError(
            f"{path} is not a readable safetensors file ({e}); copy or download it again, or re-save it "
            "with model.save_pretrained(DIR)"
        ) from None
    out = {}
    for name, info in header.items():
        if info["dtype"] not in dtypes:
            continue  # integer buffers (old GPT-2 attention masks) are not weights
        start, end = info["data_offsets"]
        dtype = np.dtype(dtypes[info["dtype"]])
        value = np.frombuffer(raw, dtype, (end - start) // dtype.itemsize, base + start)
        out[name] = value.reshape(info["shape"]).astype(np.float32)
    return out


_ITEMSIZE = dict(F64=8, F32=4, F16=2, BF16=2, I64=8, I32=4, I16=2, I8=1, U8=1, BOOL=1)
"""Bytes per element of the safetensors dtypes, for checking each tensor's extent against its shape."""


def _safetensors_header(raw: bytes) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets) and where its data starts;
    a ValueError saying what is wrong with a torn or damaged file."""
    if len(raw) < 8:
        raise ValueError(f"{len(raw)} bytes, fewer than a header needs")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise ValueError(
            f"its header claims {n:,} bytes, the file has {len(raw):,}: truncated or not safetensors"
        )
    try:
        header = json.loads(raw[8 : 8 + n])
    except ValueError:
        raise ValueError("its header is not JSON: damaged, or not a safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        try:
            (start, end), shape, kind = info["data_offsets"], info["shape"], info["dtype"]
            ok = isinstance(kind, str) and all(isinstance(x, int) and x >= 0 for x in [start, end, *shape])
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or start > end:
            raise ValueError(f"its header's entry for {name!r} is malformed")
        if 8 + n + end > len(raw):
            raise ValueError(f"truncated: {name} ends at byte {8 + n + end:,}, the file has {len(raw):,}")
        size, count = _ITEMSIZE.get(kind), math.prod(shape)
        if size is not None and (end - start) != count * size:
            raise ValueError(f"{name} holds {end - start:,} bytes, not the {count * size:,} its shape needs")
    return header, 8 + n


def read_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every weight of a checkpoint folder: model.safetensors, or the shards its index lists; PyTorch
    pickles are refused with how to re-save them."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_bytes())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{index} is not a readable safetensors index (no JSON weight_map)") from None
        missing = [f for f in files if not (hf_dir / str(f)).is_file()]
        if missing:
            raise ConfigError(f"{index} lists {missing[0]}, which is not in {hf_dir}; copy the whole folder")
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise ConfigError(
            f"{hf_dir} holds PyTorch pickles; minigpt reads safetensors only: re-save with "
            "model.save_pretrained(DIR, safe_serialization=True)"
        )
    else:
        raise ConfigError(f"{hf_dir} has no model.safetensors")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out |= read_safetensors(hf_dir / f)
    return out
