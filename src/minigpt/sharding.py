"""Device mesh and sharding rules: data parallel, FSDP and tensor parallel on one `(data, fsdp, tensor)` mesh.

Parameters carry logical axis names (`("embed", "mlp")`); `LOGICAL_RULES` maps those to the tensor axis,
and FSDP then shards each large array along its largest remaining axis divisible by the FSDP size (the
seed's openpi rule). Batches are split over data x fsdp. The active mesh is the only ambient state.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from minigpt.config import ConfigError, MeshConfig

DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = "data", "fsdp", "tensor"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": TENSOR_AXIS,
    "heads": TENSOR_AXIS,
    "mlp": TENSOR_AXIS,
    "embed": None,
}

log = logging.getLogger(__name__)


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """Resolve a -1 size and check that the sizes multiply to the device count."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if n_devices % known:
            raise ConfigError(
                f"mesh sizes {tuple(sizes)} cannot fill {n_devices} devices: {known} does not divide it"
            )
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        options = [
            f"{d}x{f}x{t}"
            for d, f, t in itertools.product(range(1, n_devices + 1), repeat=3)
            if d * f * t == n_devices
        ]
        raise ConfigError(
            f"mesh data x fsdp x tensor = {'x'.join(map(str, sizes))} = {math.prod(sizes)} devices, but there are "
            f"{n_devices}; sizes that work: {', '.join(options[:8])}{' ...' if len(options) > 8 else ''}"
        )
    return sizes[0], sizes[1], sizes[2]


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


class _MeshState:
    active_mesh: Mesh | None = None


@contextlib.contextmanager
def set_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Make `mesh` the one the model's activation constraints refer to. Nesting is refused: one mesh at a time."""
    if _MeshState.active_mesh is not None:
        raise ValueError("Cannot nest set_mesh context managers.")
    _MeshState.active_mesh = mesh
    try:
        yield mesh
    finally:
        _MeshState.active_mesh = None


def active_mesh() -> Mesh | None:
    return _MeshState.active_mesh


def activation_sharding_constraint(x: jax.Array) -> jax.Array:
    """Keep activations split along the batch over data x fsdp (a no-op outside `set_mesh`)."""
    mesh = _MeshState.active_mesh
    if mesh is None:
        return x
    spec = PartitionSpec(BATCH_AXES, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape[DATA_AXIS] * mesh.shape[FSDP_AXIS]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _fsdp_spec(shape: tuple[int, ...], spec: list, fsdp: int, nbytes: int, min_bytes: int) -> list:
    """The seed's rule: replicate scalars, vectors and small arrays; else shard the largest divisible axis."""
    if fsdp == 1 or len(shape) < 2 or nbytes < min_bytes:
        return spec
    for i in np.argsort(shape)[::-1]:
        if spec[i] is None and shape[i] % fsdp == 0:
            spec = list(spec)
            spec[i] = FSDP_AXIS
            return spec
    return spec


def param_spec(
    path: str,
    shape: tuple[int, ...],
    itemsize: int,
    axes: tuple[str | None, ...],
    mesh: Mesh,
    min_mbytes: float,
) -> PartitionSpec:
    """Tensor-parallel axes from the logical names, then FSDP on the largest remaining axis."""
    spec: list = [LOGICAL_RULES.get(a) if a else None for a in axes] if axes else [None] * len(shape)
    for dim, axis in zip(shape, spec, strict=True):
        if axis is not None and dim % mesh.shape[axis]:
            raise ConfigError(
                f"parameter {path} dimension {dim} is not divisible by mesh.{axis}={mesh.shape[axis]}"
            )
    nbytes = math.prod(shape) * itemsize
    return PartitionSpec(*_fsdp_spec(shape, spec, mesh.shape[FSDP_AXIS], nbytes, int(min_mbytes * 2**20)))


def param_shardings(abstract_state: Any, mesh: Mesh, min_mbytes: float, log_decisions: bool = False) -> Any:
    """NamedShardings mirroring an NNX state whose Variables carry logical `axes` metadata."""

    def one(path, var):
        value = var.get_value()
        names = var.get_metadata().get("axes", ())
        spec = param_spec(
            jax.tree_util.keystr(path), value.shape, value.dtype.itemsize, names, mesh, min_mbytes
        )
        if log_decisions:
            log.info("%s %s -> %s", jax.tree_util.keystr(path), value.shape, spec)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(
        one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def fsdp_sharding(pytree: Any, mesh: Mesh, *, min_size_mbytes: float = 4, log: bool = False) -> Any:
    """The seed's `fsdp_sharding` for any pytree of arrays (no logical names): FSDP only, tensor axes unused."""

    def one(path, leaf):
        spec = _fsdp_spec(
            leaf.shape,
            [None] * len(leaf.shape),
            mesh.shape[FSDP_AXIS],
            leaf.size * leaf.dtype.itemsize,
            int(min_size_mbytes * 2**20),
        )
        if log:
            logging.getLogger(__name__).info("%s %s -> %s", jax.tree_util.keystr(path), leaf.shape, spec)
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(one, pytree)
