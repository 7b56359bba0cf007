"""How and where a run runs (`--mesh.*`, `--dist.*`, `--wandb.*`): the device mesh, the processes of a
multi-process run, and Weights & Biases tracking."""

from __future__ import annotations

import dataclasses
from typing import Literal

from minigpt.runtime.errors import check


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: data parallel x FSDP x tensor parallel. One size may be -1 for 'all remaining devices'."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    fsdp_min_mbytes: float = 4.0
    """Arrays smaller than this stay replicated under FSDP: sharding them costs more than it saves."""
    cpu_devices: int = -1
    """XLA devices to split a CPU into when training (1: one; -1: one per core, as many as the mesh and batch
    allow, unless $XLA_FLAGS sets --xla_force_host_platform_device_count or the run has several processes).
    An accelerator's devices are not affected."""

    def __post_init__(self) -> None:
        check(
            self.cpu_devices == -1 or self.cpu_devices >= 1,
            f"mesh.cpu_devices must be >= 1 or -1 (one per core), got {self.cpu_devices}",
        )
        sizes = (self.data, self.fsdp, self.tensor)
        check(all(s == -1 or s >= 1 for s in sizes), f"mesh sizes must be >= 1 or -1, got {sizes}")
        check(sizes.count(-1) <= 1, f"at most one mesh size may be -1, got {sizes}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process (multi-host) start-up through `jax.distributed`. Unset: a single process.

    Each value falls back to $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and $JAX_PROCESS_ID."""

    coordinator: str | None = None
    """host:port of process 0, which serves the coordination service."""
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    """Let JAX detect the cluster instead (Cloud TPU pods, SLURM, Open MPI, Kubernetes)."""
    timeout_s: int = 120
    """How long to wait for all processes to reach the coordinator."""

    def __post_init__(self) -> None:
        check(self.timeout_s > 0, f"dist.timeout_s must be positive, got {self.timeout_s}")
        if self.num_processes is not None:
            check(self.num_processes >= 1, f"dist.num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None:
            check(
                0 <= self.process_id < self.num_processes,
                f"dist.process_id={self.process_id} must be in [0, {self.num_processes})",
            )


WANDB_MODES = ("online", "offline", "disabled")
_WANDB_PROJECT_BAD = "/\\#?%:"  # characters W&B refuses in a project name


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases tracking beside metrics.jsonl and TensorBoard (`pip install 'minigpt[wandb]'`): off
    unless a project is named. Only process 0 logs; the run's W&B id is kept in run_dir/wandb, so a resumed
    run continues the same W&B run."""

    project: str = ""
    """The W&B project to log every metric to; empty: no W&B run."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online: stream to the W&B server (after `wandb login`); offline: write it to run_dir/wandb only, for
    `wandb sync` to upload later; disabled: no W&B run, even with a project."""
    entity: str | None = None
    """The W&B user or team that owns the project; None: your W&B account's default entity."""
    name: str | None = None
    """The W&B run's display name; None: the run directory's name."""
    tags: tuple[str, ...] = ()
    """Tags for the W&B run (--wandb.tags baseline muon)."""

    def __post_init__(self) -> None:
        check(
            self.mode in WANDB_MODES,
            f"wandb.mode must be one of {', '.join(WANDB_MODES)}, got {self.mode!r}",
        )
        for name in ("entity", "name", "tags"):
            check(
                bool(self.project) or not getattr(self, name),
                f"wandb.{name} is set but wandb.project is empty; name the project: --wandb.project NAME",
            )
        check(
            len(self.project) <= 128 and not any(c in _WANDB_PROJECT_BAD for c in self.project),
            f"wandb.project {self.project!r} must be at most 128 characters without any of "
            f"{' '.join(_WANDB_PROJECT_BAD)}; give a team with --wandb.entity, not as part of the project",
        )
        for name in ("entity", "name"):
            check(
                getattr(self, name) != "", f"wandb.{name} is empty; leave --wandb.{name} out for the default"
            )
        for tag in self.tags:
            check(0 < len(tag) <= 64, f"wandb.tags: {tag!r} must be 1 to 64 characters long (W&B's limit)")

    @property
    def enabled(self) -> bool:
        """Whether a run logs to W&B: a project is named and the mode is not disabled."""
        return bool(self.project) and self.mode != "disabled"
