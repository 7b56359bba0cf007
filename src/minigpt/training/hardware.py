"""What this machine computes fastest: the peak matmul FLOP/s that MFU divides by, and the compute dtype
`--model.dtype auto` picks.

Accelerators have vendor figures (their bfloat16 tensor-core peak) and train in bfloat16. A CPU has neither:
it is measured on a machine's first runs and cached in minigpt's per-user cache folder, so `train` and `bench`
divide by the same peak. The measurement times, best of several rounds, a float32 matmul and a bfloat16 one with
float32 accumulation (what CPUs with AMX or AVX-512 BF16 run several times faster), and the forward and
backward pass of a dense block in each dtype, as the model computes them (`matmul.dense`): auto picks
bfloat16 only where that block is clearly faster. A load on the machine can only make a measurement slow,
never fast, so the cache keeps the best figure seen; the next runs measure again until SETTLED measurements,
each in a run of its own, agree on the peak (one run's rounds all share the load it started under), and a
training step that beats the peak measures again. auto's pick is made once, from a machine's first
measurement, and kept with it: later rounds refine the peak, but a pick that followed them (load can tip a
close one) would change the numbers between two runs, or two sessions of one run, on the same machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.runtime import files
from minigpt.runtime.files import user_cache_dir

BF16_SPEEDUP = 1.1
"""auto picks bfloat16 on a CPU whose dense block trains at least this much faster than in float32."""
AGREE = 0.9
"""Two measured peaks agree when the lower is at least this fraction of the higher."""
SETTLED = 3
"""Runs whose measurements agree before a cached peak is trusted without measuring again."""
MAX_MEASUREMENTS = 6
"""Runs that measure at most: a machine that is always busy keeps the best of these."""
PLAUSIBLE_PEAK = (1e7, 1e16)
"""FLOP/s a host's CPU matmul peak lies between: a cached figure outside is not a measurement, and is measured
again (a slow core under heavy load does more than the first, the largest AMX server far less than the second)."""

# Vendor peak dense (not 2:4-sparse) throughput per device, TFLOP/s: (pattern on `device.device_kind`,
# bf16, tf32, fp32). The first matching pattern wins, so specific names come before general ones. Sources:
# NVIDIA's H100/H200/A100/L4/L40S/B200 datasheets (which quote tensor-core figures with sparsity: halved here)
# and Google Cloud's TPU system-architecture pages (bf16 per chip).
PEAK_TFLOPS: tuple[tuple[str, float | None, float | None, float | None], ...] = (
    (r"GH200", 989.0, 494.0, 67.0),
    (r"H100.*PCIe", 756.0, 378.0, 51.0),
    (r"H[12]00.*NVL", 835.0, 417.0, 60.0),
    (r"H100|H200", 989.0, 494.0, 67.0),  # SXM
    (r"B200", 2250.0, 1125.0, 75.0),
    (r"A100", 312.0, 156.0, 19.5),
    (r"L40S", 362.0, 183.0, 91.6),
    (r"\bL4\b", 121.0, 60.0, 30.3),
    (r"\bA10\b", 125.0, 62.5, 31.2),
    (r"V100", None, None, 15.7),  # no bf16 tensor cores
    (r"TPU v2", 45.0, None, None),
    (r"TPU v3", 123.0, None, None),
    (r"TPU v4", 275.0, None, None),
    (r"TPU v5 ?(lite|e)", 197.0, None, None),
    (r"TPU v5", 459.0, None, None),  # v5p
    (r"TPU v6", 918.0, None, None),  # v6e (Trillium)
    (r"TPU ?7|TPU v7", 2307.0, None, None),  # Ironwood
)


def _float32_uses_tf32() -> bool:
    """JAX's DEFAULT matmul precision lets GPUs run float32 matmuls on TF32 tensor cores."""
    import jax

    precision = str(jax.config.jax_default_matmul_precision or "default").lower()
    return precision not in ("highest", "float32", "fp32")


def table_peak_flops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """Peak FLOP/s per device from PEAK_TFLOPS for `dtype` matmuls, or None for a device kind it does not know.

    float32 uses the TF32 figure where the chip has one (JAX's default precision), unless
    `jax_default_matmul_precision` asks for full float32. TPUs run float32 matmuls at default precision as
    bfloat16 passes on the MXU, so their bfloat16 figure stands for both."""
    for pattern, bf16, tf32, fp32 in PEAK_TFLOPS:
        if re.search(pattern, device_kind, re.IGNORECASE):
            if dtype == "bfloat16" or device_kind.upper().startswith("TPU"):
                value = bf16
            else:
                value = tf32 if tf32 is not None and _float32_uses_tf32() else fp32
            return None if value is None else value * 1e12
    return None


# --------------------------------------------------------------------------------------------- measuring


def _best_seconds(fn: Any, args: tuple, repeats: int) -> float:
    """The fastest of `repeats` timed calls of a jitted `fn`, each waited for, after one that compiles."""
    import jax

    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def matmul_flops(dtype: str, n: int = 1024, repeats: int = 8) -> float:
    """FLOP/s of the fastest of `repeats` jitted (n, n) @ (n, n) products on one CPU device: float32, or
    bfloat16 operands accumulated in float32."""
    import jax
    import jax.numpy as jnp

    from minigpt.nn.matmul import dot

    x = jax.device_put(np.ones((n, n), jnp.dtype(dtype)), jax.devices("cpu")[0])
    return 2 * n**3 / _best_seconds(jax.jit(lambda a, b: dot(a, b, (1, 0))), (x, x), repeats)


BLOCK_ROWS, BLOCK_D = 2048, 256


def dense_block_flops(rows: int = BLOCK_ROWS, d: int = BLOCK_D) -> float:
    """The model FLOPs of `dense_block_seconds`'s pass: two d x 4d products, forward and backward (3x)."""
    return 3 * 2 * (2 * rows * d * 4 * d)


def dense_block_seconds(dtype: str, rows: int = BLOCK_ROWS, d: int = BLOCK_D, repeats: int = 5) -> float:
    """Seconds of the fastest forward and backward pass of two dense layers (d -> 4d -> d, ReLU between)
    over `rows` rows, computed as the model's `Linear` computes in `dtype`."""
    import jax
    import jax.numpy as jnp

    from minigpt.nn.matmul import dense

    compute = jnp.dtype(dtype)

    def linear(x: jax.Array, w: jax.Array) -> jax.Array:
        return x @ w if compute == jnp.float32 else dense(x, w, None, compute)

    def loss(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        return jnp.sum(linear(jax.nn.relu(linear(x, w1)), w2).astype(jnp.float32))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, d)).astype(compute)
    w1, w2 = (0.02 * rng.standard_normal(shape, np.float32) for shape in ((d, 4 * d), (4 * d, d)))
    return _best_seconds(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (x, w1, w2), repeats)


@dataclasses.dataclass(frozen=True)
class CpuProbe:
    """One machine's measurements: matmul FLOP/s and a dense block's training seconds per dtype."""

    float32_flops: float
    bfloat16_flops: float
    float32_block_s: float
    bfloat16_block_s: float

    @property
    def peak_flops(self) -> float:
        return max(self.float32_flops, self.bfloat16_flops)

    @property
    def peak_name(self) -> str:
        """The matmul the peak is: the fastest this CPU offers."""
        if self.bfloat16_flops > self.float32_flops:
            return "bfloat16 x bfloat16 -> float32 matmul"
        return "float32 matmul"

    @property
    def bf16_speedup(self) -> float:
        return self.float32_block_s / self.bfloat16_block_s

    @property
    def bf16_faster(self) -> bool:
        """Whether a dense layer trains clearly faster in bfloat16, and this CPU's bfloat16 matmul is the faster
        one too: one that is slower emulates bfloat16, so a faster layer would be a measurement gone wrong."""
        return self.bf16_speedup >= BF16_SPEEDUP and self.bfloat16_flops > self.float32_flops

    def valid(self) -> bool:
        """Whether the figures could be a measurement of a real CPU (a cache file can hold anything): numbers, a
        peak and dense-layer rates in PLAUSIBLE_PEAK, and no layer trained several times faster than the peak
        (its products are matmuls; load, which only slows a measurement, does not make that up)."""
        values = dataclasses.astuple(self)
        if not all(type(v) in (int, float) and math.isfinite(v) and v > 0 for v in values):
            return False
        low, high = PLAUSIBLE_PEAK
        rates = [dense_block_flops() / s for s in (self.float32_block_s, self.bfloat16_block_s)]
        return all(low <= r <= high for r in (self.peak_flops, *rates)) and max(rates) <= 8 * self.peak_flops

    def best_with(self, other: CpuProbe) -> CpuProbe:
        """The faster figure of each measurement: load only ever slows a measurement down."""
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        fields = dataclasses.fields(self)
        best = [
            max(a, b) if f.name.endswith("flops") else min(a, b)
            for f, (a, b) in zip(fields, pairs, strict=True)
        ]
        return CpuProbe(*best)


def measure_cpu(rounds: int = 3) -> CpuProbe:
    """The best of `rounds` measurements of every figure, the dtypes interleaved so a passing load slows
    both alike. Its programs stay out of the compilation cache: a machine runs them once."""
    import jax

    # Its inputs come from numpy, so it compiles only programs of its own, and none is stored (the on/off
    # switch would not do: JAX reads it once per process).
    option = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, option)
    jax.config.update(option, math.inf)
    try:
        return _measure_cpu(rounds)
    finally:
        jax.config.update(option, before)


def _measure_cpu(rounds: int) -> CpuProbe:
    best: CpuProbe | None = None
    for _ in range(rounds):
        probe = CpuProbe(
            matmul_flops("float32"),
            matmul_flops("bfloat16"),
            dense_block_seconds("float32"),
            dense_block_seconds("bfloat16"),
        )
        best = probe if best is None else best.best_with(probe)
    assert best is not None
    return best


# --------------------------------------------------------------------------------------------- the cache


def cache_path() -> Path:
    """Where a machine's measurements are kept: in minigpt's per-user cache folder."""
    return user_cache_dir() / "machine.json"


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it ("unknown CPU" where /proc/cpuinfo does not say)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else "unknown CPU"


def host_key() -> str:
    """The machine as far as a CPU matmul's speed goes: its CPU model and the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()} x {cores} cores"


def _read_cache() -> dict:
    try:
        cache = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


@dataclasses.dataclass(frozen=True)
class Cached:
    """A machine's cached probe, how many runs' measurements agree with its peak, and how many runs measured."""

    probe: CpuProbe
    agreeing: int = 1
    measured: int = 1
    dtype: str = ""
    """auto's pick on this machine, made at its first measurement ("": none yet, an older minigpt's entry)."""
    speedup: float = 0.0
    """The dense layer's speed-up in bfloat16 that the pick was made at."""

    def settled(self) -> bool:
        return self.agreeing >= SETTLED or self.measured >= MAX_MEASUREMENTS

    def picking(self) -> Cached:
        """With auto's pick made from the figures as they stand, unless one is made already."""
        if self.dtype:
            return self
        dtype = "bfloat16" if self.probe.bf16_faster else "float32"
        return dataclasses.replace(self, dtype=dtype, speedup=self.probe.bf16_speedup)

    def plausible(self) -> bool:
        """Counts that are small whole numbers, figures a CPU measures (`CpuProbe.valid`), and a pick that
        figures made: bfloat16 only at a speed-up of BF16_SPEEDUP, on a CPU whose bfloat16 matmul is faster."""
        counts = all(type(n) is int and 0 <= n <= 1_000_000 for n in (self.agreeing, self.measured))
        pick = self.dtype in ("", "float32", "bfloat16") and type(self.speedup) in (int, float)
        bf16 = self.dtype != "bfloat16" or (
            self.speedup >= BF16_SPEEDUP and self.probe.bfloat16_flops > self.probe.float32_flops
        )
        return (
            counts
            and pick
            and math.isfinite(self.speedup)
            and self.speedup >= 0
            and bf16
            and self.probe.valid()
        )

    def adding(self, new: CpuProbe) -> Cached:
        """The cache after another run's measurement: the best of each figure. A new peak well above the old
        one shows the old was measured under load, so only the new one agrees with it; one well below it was
        measured under load itself, and does not."""
        merged, measured = self.probe.best_with(new), self.measured + 1
        if new.peak_flops * AGREE > self.probe.peak_flops:
            return dataclasses.replace(self, probe=merged, agreeing=1, measured=measured)
        agrees = new.peak_flops >= AGREE * self.probe.peak_flops
        return dataclasses.replace(self, probe=merged, agreeing=self.agreeing + agrees, measured=measured)


def cached_probe() -> Cached | None:
    """This machine's cache entry, or None where there is none or it could not be a measurement (`valid`;
    counts that are not small whole numbers): a damaged or hand-edited file is measured again, never trusted.
    An entry without counts (an older minigpt's) counts as one measurement."""
    entry = _read_cache().get(host_key())
    try:
        kept = {k: entry.pop(k) for k in ("agreeing", "measured", "dtype", "speedup") if k in entry}
        cached = Cached(CpuProbe(**entry), **kept)
    except (AttributeError, TypeError):
        return None
    return cached if cached.plausible() else None


def _store(cached: Cached) -> None:
    entry = {**dataclasses.asdict(cached.probe), "agreeing": cached.agreeing, "measured": cached.measured}
    entry |= {"dtype": cached.dtype, "speedup": cached.speedup}
    try:
        cache_path().parent.mkdir(parents=True, exist_ok=True)
        files.write_json(cache_path(), {**_read_cache(), host_key(): entry})
    except OSError:  # a read-only home still gets MFU and auto, measured per process
        pass


_PROBES: dict[Path, Cached] = {}  # this process's entry, per cache file: a run measures at most once


def cpu_probe() -> CpuProbe:
    """This machine's probe: measured (a few seconds) the first time, then read from the cache; until
    SETTLED runs agree on its peak, each run adds one more round of measurement (about a second)."""
    return _machine().probe


def _machine() -> Cached:
    """This machine's entry, as `cpu_probe` says, with auto's pick. Processes measure one at a time: one that
    waited reads what the other measured (two measuring at once would slow each other down)."""
    path = cache_path()
    if path not in _PROBES:
        with _measuring():
            cached = cached_probe()
            if cached is None:
                cached = Cached(measure_cpu()).picking()
                _store(cached)
            elif not cached.settled() or not cached.dtype:
                cached = (cached if cached.settled() else cached.adding(measure_cpu(rounds=1))).picking()
                _store(cached)
        _PROBES[path] = cached
    return _PROBES[path]


def _measuring() -> contextlib.AbstractContextManager:
    """The cache's lock, where its folder takes one (a read-only home: each process measures for itself)."""
    with contextlib.suppress(OSError):
        cache_path().parent.mkdir(parents=True, exist_ok=True)
    if os.access(cache_path().parent, os.W_OK):
        return files.locked(cache_path().with_suffix(".lock"))
    return contextlib.nullcontext()


def forget_probe() -> None:
    """Read the cache again at the next `cpu_probe()`, as another run would."""
    _PROBES.clear()


def settle_probe() -> CpuProbe:
    """Measure as the next runs would until the cache is settled: for a benchmark whose timed runs must not
    measure (run it on an idle machine)."""
    for _ in range(MAX_MEASUREMENTS):  # bounded: a read-only cache never settles
        if (cached := cached_probe()) is not None and cached.settled():
            break
        forget_probe()
        cpu_probe()
    return cpu_probe()


def remeasure_peak(achieved_flops: float) -> CpuProbe:
    """A step ran at `achieved_flops` (the host's whole CPU), beating the cached peak: measure again and keep
    the best of the old figures, the new ones and the step's (a peak below a real step was measured under
    load, so the runs that agree with it start again from this one)."""
    before = cached_probe() or _machine()
    probe = before.probe.best_with(measure_cpu(rounds=1))
    if probe.peak_flops < achieved_flops:
        probe = dataclasses.replace(probe, bfloat16_flops=max(probe.bfloat16_flops, achieved_flops))
    after = dataclasses.replace(before, probe=probe, agreeing=1, measured=before.measured + 1).picking()
    _store(after)
    _PROBES[cache_path()] = after
    return probe


# --------------------------------------------------------------------------------------------- the answers


@dataclasses.dataclass(frozen=True)
class Peak:
    """The peak MFU divides by: FLOP/s per device, and what it is (for every line that prints MFU)."""

    flops: float
    source: str


# Vendor peak memory bandwidth per device, GB/s (pattern on `device.device_kind`; the first match wins), from
# the same datasheets and pages: what bounds decoding one token at a time, which reads every weight per step.
PEAK_MEMORY_GBPS: tuple[tuple[str, float], ...] = (
    (r"H200", 4800.0),
    (r"H100.*PCIe", 2000.0),
    (r"H100", 3350.0),  # SXM
    (r"A100.*40GB", 1555.0),
    (r"A100", 2039.0),
    (r"\bL4\b", 300.0),
    (r"TPU v4", 1200.0),
    (r"TPU v5 ?(lite|e)", 819.0),
    (r"TPU v5", 2765.0),  # v5p
    (r"TPU v6", 1640.0),  # v6e (Trillium)
)


def memory_bandwidth(device_kind: str) -> float | None:
    """The vendor's peak memory bandwidth (bytes/s) of an accelerator, or None for a kind not in the table."""
    return next((gbps * 1e9 for pattern, gbps in PEAK_MEMORY_GBPS if re.search(pattern, device_kind)), None)


def peak(device: Any, peak_tflops: float | None = None) -> Peak | None:
    """The fastest matmul one device offers, for MFU; None where it is unknown (pass --peak-tflops).

    Accelerators: the vendor's bfloat16 figure for `device.device_kind` (float32 where the chip has no bf16
    units). CPUs: the measured host peak, split evenly among the process's CPU devices, which share the
    host's cores (emulated ones included), so devices x peak per device is the host's peak."""
    if peak_tflops is not None:
        return Peak(peak_tflops * 1e12, "--peak-tflops")
    if device.platform == "cpu":
        import jax

        probe = cpu_probe()
        return Peak(
            probe.peak_flops / len(jax.local_devices(backend="cpu")),
            f"this CPU's fastest, a {probe.peak_name}, measured and cached in {cache_path()}",
        )
    for dtype in ("bfloat16", "float32"):
        if (flops := table_peak_flops(device.device_kind, dtype)) is not None:
            return Peak(flops, f"the vendor's dense {dtype} figure for {device.device_kind}")
    return None


def training_flops(device: Any, dtype: str, peak_tflops: float | None = None) -> float | None:
    """FLOP/s per device that no training step of a model in `dtype` beats, for how far a time budget can
    read its corpus: on a CPU the rate it trains a dense block at (the model's most efficient part; a whole
    step, with attention, the loss and the optimizer, runs slower), elsewhere the peak. None where unknown."""
    if device.platform != "cpu" or peak_tflops is not None:
        found = peak(device, peak_tflops)
        return None if found is None else found.flops
    import jax

    block_s = getattr(cpu_probe(), f"{dtype}_block_s")
    return dense_block_flops() / block_s / len(jax.local_devices(backend="cpu"))


def compute_dtype(setting: str, platform: str) -> tuple[str, str]:
    """The compute dtype for `--model.dtype setting` on `platform`, and why, for the run's first lines."""
    if setting != "auto":
        return setting, f"--model.dtype {setting}"
    if platform != "cpu":
        return "bfloat16", "--model.dtype auto: bfloat16 on an accelerator's matrix units"
    machine = _machine()
    slower = machine.dtype == "float32" and machine.speedup >= BF16_SPEEDUP  # its matmul was the slower
    return machine.dtype, (
        f"--model.dtype auto: a dense layer trains {machine.speedup:.2f}x as fast in bfloat16 as in float32 on "
        f"this CPU{', whose bfloat16 matmul is the slower' if slower else ''} (measured when first seen, kept "
        f"in {cache_path()})"
    )
