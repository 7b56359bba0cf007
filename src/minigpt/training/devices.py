"""The device kinds a memory plan knows, and how much of a device's memory a step may use."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax

from minigpt.config import ConfigError

GIB = 2**30
GPU_MEMORY_FRACTION = 0.75
"""JAX's default share of a GPU's memory its allocator may use (XLA_PYTHON_CLIENT_MEM_FRACTION)."""


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    name: str
    pattern: str
    """Matches `jax.Device.device_kind` of such a device (case-insensitive)."""
    gib: float
    """Memory per device, GiB (cpu: 0, read from the host)."""

    @property
    def is_gpu(self) -> bool:
        return self.name.startswith(("h1", "h2", "a100"))

    @property
    def is_tpu(self) -> bool:
        return self.name.startswith("tpu")


DEVICE_KINDS = {
    k.name: k
    for k in (
        DeviceKind("cpu", r"^cpu$", 0.0),
        DeviceKind("h100", r"H100", 80.0),
        DeviceKind("h200", r"H200", 141.0),
        DeviceKind("a100-40gb", r"A100(?!.*80)", 40.0),
        DeviceKind("a100-80gb", r"A100.*80", 80.0),
        DeviceKind("tpu-v4", r"TPU v4", 32.0),
        DeviceKind("tpu-v5e", r"TPU v5 ?(lite|e)", 16.0),
        DeviceKind("tpu-v5p", r"TPU v5", 95.0),
        DeviceKind("tpu-v6e", r"TPU v6", 32.0),
    )
}
"""Device kinds a plan knows, by `--device` name; the first whose pattern matches names a local device."""


def device_kind(name: str) -> DeviceKind:
    if name not in DEVICE_KINDS:
        raise ConfigError(f"unknown device kind {name!r}; choose one of: {', '.join(DEVICE_KINDS)}")
    return DEVICE_KINDS[name]


def local_kind(device: Any = None) -> str:
    """The `DEVICE_KINDS` name of a local device (default: the first of the default backend)."""
    device = device if device is not None else jax.devices()[0]
    label = "cpu" if device.platform == "cpu" else device.device_kind
    for kind in DEVICE_KINDS.values():
        if re.search(kind.pattern, label, re.IGNORECASE):
            return kind.name
    raise ConfigError(f"no plan for device kind {label!r}; pass --device, one of: {', '.join(DEVICE_KINDS)}")


def host_memory_bytes() -> int:
    """MemTotal of /proc/meminfo (the host's RAM)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def capacity(kind: str, devices: int) -> tuple[int, str]:
    """Bytes one device may use, and how that figure was made. cpu: the host's RAM split over the CPU devices
    sharing it (this process's, or the `devices` emulated ones a plan for another count stands for). GPUs:
    JAX's allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of the memory (0.75 unless set)."""
    k = device_kind(kind)
    if k.name == "cpu":
        local = len(jax.local_devices(backend="cpu"))
        sharing = local if devices == jax.device_count() else devices
        ram = host_memory_bytes()
        return ram // sharing, f"cpu: host RAM {fmt_bytes(ram)} / {sharing} device(s)"
    if k.is_gpu:
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION))
        note = f"{k.name}: {k.gib:g} GiB x {fraction:g} (JAX's GPU memory fraction)"
        return int(k.gib * GIB * fraction), note
    return int(k.gib * GIB), f"{k.name}: {k.gib:g} GiB"


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"
