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
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from minigpt.config import ConfigError, DistributedConfig, MeshConfig

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
    rules = {name: axis if axis and mesh.shape[axis] > 1 else None for name, axis in LOGICAL_RULES.items()}
    spec: list = [rules.get(a) if a else None for a in axes] if axes else [None] * len(shape)
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
        names = tuple(var.get_metadata().get("axes", ()))
        names = (None,) * (value.ndim - len(names)) + names  # scanned layers: a leading, unsharded layer axis
        spec = param_spec(
            jax.tree_util.keystr(path), value.shape, value.dtype.itemsize, names, mesh, min_mbytes
        )
        if log_decisions:
            log.info("%s %s -> %s", jax.tree_util.keystr(path), value.shape, spec)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(
        one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def like_params(tree: Any, abstract_params: Any, param_shardings: Any, default: NamedSharding) -> Any:
    """Shardings for optimizer state: each leaf that mirrors a parameter (Adam's moments, momentum; found by
    its path ending in the parameter's path, with the same shape) is sharded like that parameter, the rest
    (counts, scalars) get `default`. Works through any optax state, masked or multi-transform ones included."""
    by_path = {
        jax.tree_util.keystr(p): (leaf.shape, sh)
        for (p, leaf), sh in zip(
            jax.tree_util.tree_leaves_with_path(abstract_params),
            jax.tree.leaves(param_shardings),
            strict=True,
        )
    }

    def one(path, leaf):
        key = jax.tree_util.keystr(path)
        for param_path, (shape, sh) in by_path.items():
            if key.endswith(param_path) and leaf.shape == shape:
                return sh
        return default

    return jax.tree_util.tree_map_with_path(one, tree)


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


def initialize_distributed(cfg: DistributedConfig) -> bool:
    """Join a multi-process run through `jax.distributed` (flags, then $JAX_* variables, or auto-detection).

    Returns whether this is a multi-process run. Must run before anything touches the devices. On CPU the
    processes exchange collectives through gloo."""
    coordinator = cfg.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = cfg.num_processes or _env_int("JAX_NUM_PROCESSES")
    process_id = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    if not coordinator and not cfg.auto:
        return False
    if coordinator and (num_processes is None or process_id is None):
        raise ConfigError(
            "--dist.coordinator needs --dist.num-processes and --dist.process-id (or $JAX_* variables)"
        )
    if coordinator and process_id != 0:
        _wait_for_coordinator(coordinator, cfg.timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {"initialization_timeout": cfg.timeout_s}
    if coordinator:
        kwargs |= {
            "coordinator_address": coordinator,
            "num_processes": num_processes,
            "process_id": process_id,
        }
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:
        where = f"coordinator {coordinator}" if coordinator else "the cluster's coordinator"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"could not join the distributed run via {where} within {cfg.timeout_s}s: {first_line}"
        ) from None
    return jax.process_count() > 1


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Probe the coordinator's port first: JAX's client aborts the whole process (no exception) if it cannot
    connect, which would leave the user a C++ stack trace instead of a reason."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--dist.coordinator must be host:port, got {address!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"coordinator {address} unreachable within {timeout_s}s ({e.strerror or e}); start process 0 "
                    "first and check --dist.coordinator"
                ) from None
            time.sleep(0.5)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {value!r}") from None
