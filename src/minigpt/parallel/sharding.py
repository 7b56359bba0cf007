"""Device mesh and sharding rules: data parallel, FSDP and tensor parallel on one `(data, fsdp, tensor)` mesh.

The API the trainer uses: `make_mesh`, `set_mesh` (the active mesh is the only ambient state),
`activation_sharding_constraint` (inside the model), `fsdp_sharding` (a whole train state's shardings) and
`batch_sharding` / `global_batch` (every batch). Parameters carry logical axis names (`("embed", "mlp")`);
`LOGICAL_RULES` maps those to the tensor axis, and FSDP then shards each large array along its largest
remaining axis divisible by the FSDP size. Batches are split over data x fsdp.
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


def logical_axes(param: nnx.Variable) -> tuple[str | None, ...]:
    """A parameter's logical axis names, one per axis of its value: a leading None for the layer axis of
    scanned layers."""
    axes = tuple(param.get_metadata().get("axes", ()))
    return (None,) * (param.get_value().ndim - len(axes)) + axes


def gathered(param: nnx.Variable, keep: int | None = None) -> jax.Array:
    """A parameter's value as a layer uses it under FSDP: whole along the FSDP axis, still split over the
    tensor axis, so XLA gathers the weight before its product or lookup and reduce-scatters its gradient.
    Left to itself, XLA moves a weight's FSDP split onto the activations instead; where that split lies on
    the batch already it cannot, and it replicates them on every device. `keep`: an axis whose FSDP split
    stays, a table's vocabulary, which lookups take split. A no-op outside `set_mesh` or without FSDP."""
    value, mesh = param.get_value(), _MeshState.active_mesh
    if mesh is None or mesh.shape[FSDP_AXIS] == 1:
        return value
    spec = _tensor_spec(logical_axes(param), mesh)
    if keep is not None and _fsdp_spec(value.shape, spec, mesh.shape[FSDP_AXIS], 1, 0)[keep] == FSDP_AXIS:
        return value
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, PartitionSpec(*spec)))


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape[DATA_AXIS] * mesh.shape[FSDP_AXIS]


def batch_sharding(mesh: Mesh, micro_batches: bool = False) -> NamedSharding:
    """Rows split over data x fsdp: for (batch, ...) arrays, or (micro-batch, batch, ...) ones."""
    return NamedSharding(mesh, PartitionSpec(*((None,) if micro_batches else ()), BATCH_AXES))


def global_batch(mesh: Mesh, local_rows: np.ndarray, micro_batches: bool = False) -> jax.Array:
    """One global array from each process's own rows (the batch axis is split over processes)."""
    return jax.make_array_from_process_local_data(batch_sharding(mesh, micro_batches), local_rows)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _fsdp_spec(shape: tuple[int, ...], spec: list, fsdp: int, nbytes: int, min_bytes: int) -> list:
    """Replicate scalars, vectors and arrays under `min_bytes` (sharding them costs more communication than
    it saves memory); shard anything else along its largest axis that the FSDP size divides."""
    if fsdp == 1 or len(shape) < 2 or nbytes < min_bytes:
        return spec
    for i in np.argsort(shape)[::-1]:
        if spec[i] is None and shape[i] % fsdp == 0:
            spec = list(spec)
            spec[i] = FSDP_AXIS
            return spec
    return spec


def _tensor_spec(axes: tuple[str | None, ...], mesh: Any) -> list:
    """The mesh axis each logical axis name maps to, where that mesh axis has more than one device."""
    rules = {name: axis if axis and mesh.shape[axis] > 1 else None for name, axis in LOGICAL_RULES.items()}
    return [rules.get(a) if a else None for a in axes]


def param_spec(
    path: str,
    shape: tuple[int, ...],
    itemsize: int,
    axes: tuple[str | None, ...],
    mesh: Mesh,
    min_mbytes: float,
) -> PartitionSpec:
    """Tensor-parallel axes from the logical names, then FSDP on the largest remaining axis."""
    spec: list = _tensor_spec(axes, mesh) if axes else [None] * len(shape)
    for dim, axis in zip(shape, spec, strict=True):
        if axis is not None and dim % mesh.shape[axis]:
            raise ConfigError(
                f"parameter {path} dimension {dim} is not divisible by mesh.{axis}={mesh.shape[axis]}"
            )
    nbytes = math.prod(shape) * itemsize
    return PartitionSpec(*_fsdp_spec(shape, spec, mesh.shape[FSDP_AXIS], nbytes, int(min_mbytes * 2**20)))


def fsdp_sharding(pytree: Any, mesh: Mesh, *, min_size_mbytes: float = 4, log: bool = False) -> Any:
    """NamedShardings for every array of a pytree (a whole train state: params, optimizer state, counters).

    An NNX Variable that carries logical `axes` metadata (every parameter, and every optimizer moment that
    mirrors one) is split over the tensor axis by `LOGICAL_RULES`; then any array of at least
    `min_size_mbytes` is split over the FSDP axis along its largest remaining axis that divides evenly.
    Scalars, vectors and small arrays stay replicated."""

    def one(path: Any, leaf: Any) -> Any:
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        if not hasattr(value, "shape"):  # an empty placeholder (a masked-out optimizer state): no arrays
            return leaf
        names = logical_axes(leaf) if isinstance(leaf, nnx.Variable) else (None,) * value.ndim
        key = jax.tree_util.keystr(path)
        spec = param_spec(key, value.shape, value.dtype.itemsize, names, mesh, min_size_mbytes)
        if log:
            logging.getLogger(__name__).info("%s %s -> %s", key, value.shape, spec)
        named = NamedSharding(mesh, spec)
        return leaf.replace(named) if isinstance(leaf, nnx.Variable) else named

    return jax.tree_util.tree_map_with_path(one, pytree, is_leaf=lambda x: isinstance(x, nnx.Variable))
