"""The machine's peak and compute dtype: vendor figures for accelerators, a CPU measured on its first runs and
cached, a cached figure that is damaged or measured under load replaced, and what `--model.dtype auto` picks."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import jax
import pytest
from conftest import WORKDIR, subprocess_env

from minigpt.runtime import files
from minigpt.training import hardware
from minigpt.training.hardware import CpuProbe, compute_dtype, memory_bandwidth, peak, table_peak_flops
from minigpt.training.metrics import mfu

H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize(
    ("kind", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989),
        ("NVIDIA H100 80GB HBM3", "float32", 494),  # TF32 at JAX's default precision
        ("NVIDIA H100 PCIe", "bfloat16", 756),
        ("NVIDIA H100 NVL", "bfloat16", 835),
        ("NVIDIA H200", "bfloat16", 989),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312),
        ("NVIDIA A100 80GB PCIe", "float32", 156),
        ("NVIDIA A10", "bfloat16", 125),
        ("NVIDIA L4", "bfloat16", 121),
        ("NVIDIA L40S", "bfloat16", 362),
        ("TPU v4", "bfloat16", 275),
        ("TPU v5 lite", "bfloat16", 197),
        ("TPU v5e", "float32", 197),
        ("TPU v5", "bfloat16", 459),
        ("TPU v5p", "bfloat16", 459),
        ("TPU v6 lite", "bfloat16", 918),
    ],
)
def test_peak_table_matches_vendor_dense_figures(kind: str, dtype: str, tflops: float) -> None:
    assert table_peak_flops(kind, dtype) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    ("kind", "gbps"),
    [("TPU v5 lite", 819), ("TPU v5e", 819), ("TPU v5p", 2765), ("TPU v4", 1200), ("NVIDIA H100 80GB HBM3", 3350),
     ("NVIDIA H100 PCIe", 2000), ("NVIDIA A100-SXM4-40GB", 1555), ("NVIDIA A100-SXM4-80GB", 2039)],
)  # fmt: skip
def test_memory_bandwidth_table_names_the_vendor_figures(kind: str, gbps: float) -> None:
    """Decoding's bound (bench_generate) divides by it: the v5 lite must not take the v5p's figure."""
    assert memory_bandwidth(kind) == pytest.approx(gbps * 1e9)
    assert memory_bandwidth("cpu") is None and memory_bandwidth("Some Future Chip") is None


def test_an_accelerators_peak_is_its_fastest_matmul_whatever_the_model_computes_in() -> None:
    with jax.default_matmul_precision("float32"):
        assert table_peak_flops("NVIDIA H100 80GB HBM3", "float32") == pytest.approx(67e12)
    assert peak(H100).flops == pytest.approx(989e12)
    assert "bfloat16 figure for NVIDIA H100" in peak(H100).source
    v100 = types.SimpleNamespace(platform="gpu", device_kind="Tesla V100-SXM2-16GB")  # no bf16 units
    assert peak(v100).flops == pytest.approx(15.7e12) and "float32" in peak(v100).source
    assert peak(H100, peak_tflops=100.0) == hardware.Peak(100e12, "--peak-tflops")
    assert peak(types.SimpleNamespace(platform="gpu", device_kind="Mystery GPU")) is None
    assert mfu(1e12, 2.0, 4, None) is None
    assert compute_dtype("auto", "gpu")[0] == compute_dtype("auto", "tpu")[0] == "bfloat16"
    assert compute_dtype("float32", "gpu") == ("float32", "--model.dtype float32")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty per-user cache folder of this test's own, and no probe remembered by this process."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    hardware.forget_probe()
    yield tmp_path / "machine.json"
    hardware.forget_probe()


def _store(path: Path, agreeing: int = hardware.SETTLED, measured: int = hardware.SETTLED, **figures) -> None:
    """Cache `figures` for this machine, by default as a peak that enough runs agree on to be read as is."""
    files.write_json(path, {hardware.host_key(): {**figures, "agreeing": agreeing, "measured": measured}})


def _entry(path: Path) -> dict:
    return json.loads(path.read_text())[hardware.host_key()]


def _figures(path: Path) -> dict:
    return {k: v for k, v in _entry(path).items() if k not in ("agreeing", "measured", "dtype", "speedup")}


def _counted(path: Path) -> dict:
    """The entry's figures and counts, less auto's pick."""
    return {k: v for k, v in _entry(path).items() if k not in ("dtype", "speedup")}


def _cached_counts(path: Path) -> tuple[int, int]:
    return _entry(path)["agreeing"], _entry(path)["measured"]


LOW = dict(float32_flops=1e8, bfloat16_flops=2e8, float32_block_s=50.0, bfloat16_block_s=60.0)
"""A machine's figures as a run under heavy load measures them: slow, yet a measurement."""


def test_a_cpu_is_measured_once_and_every_device_gets_its_share(cache: Path) -> None:
    """`train` and `bench` divide by the same peak: the first call on a machine measures and caches it, later
    calls (in any process) read it. The peak is the faster of the float32 and bfloat16 matmuls."""
    probe = hardware.cpu_probe()
    assert 1e8 < probe.float32_flops < 1e14 and 1e8 < probe.bfloat16_flops < 1e14
    assert _counted(cache) == {**dataclasses.asdict(probe), "agreeing": 1, "measured": 1}
    assert hardware.cpu_probe() is probe and _entry(cache)["measured"] == 1  # a process measures once
    assert hardware.cpu_model() in hardware.host_key()
    hardware.forget_probe()
    _store(cache, float32_flops=1e9, bfloat16_flops=5e9, float32_block_s=2.0, bfloat16_block_s=1.0)
    n = len(jax.devices("cpu"))
    found = peak(jax.devices("cpu")[0])
    assert found.flops == pytest.approx(5e9 / n)
    assert "bfloat16 x bfloat16 -> float32 matmul" in found.source and str(cache) in found.source
    assert mfu(5e9 / n, 1.0, n, found.flops) == pytest.approx(1.0)


def test_a_damaged_cached_figure_is_measured_again_never_trusted(cache: Path) -> None:
    for bad in (-2.5e10, 0.0, math.nan, math.inf, "fast", None, True):
        _store(cache, float32_flops=bad, bfloat16_flops=5e9, float32_block_s=2.0, bfloat16_block_s=1.0)
        assert hardware.cached_probe() is None, bad
    for count in (math.inf, 1.5, "3", -1, None, True):  # JSON's Infinity (or 1e400) once overflowed int()
        _store(
            cache,
            agreeing=count,
            float32_flops=1e9,
            bfloat16_flops=5e9,
            float32_block_s=2.0,
            bfloat16_block_s=1.0,
        )
        assert hardware.cached_probe() is None, count
    cache.write_text(cache.read_text().replace('"agreeing": null', '"agreeing": Infinity'))
    assert hardware.cached_probe() is None
    probe = hardware.cpu_probe()
    assert probe.valid() and probe.bfloat16_flops != 5e9  # measured, not read
    assert _counted(cache) == {**dataclasses.asdict(probe), "agreeing": 1, "measured": 1}


def test_a_step_faster_than_a_peak_measured_under_load_raises_it(cache: Path) -> None:
    """A peak cached while the machine was busy is too low: a step that beats it measures again, and the
    cache keeps the best of the old figures, the new ones and the step's."""
    _store(cache, **LOW)
    raised = hardware.remeasure_peak(achieved_flops=1e15)  # faster than any real measurement
    assert raised.peak_flops == 1e15 and raised.float32_flops > LOW["float32_flops"]
    assert raised.float32_block_s < 50.0 and raised.bfloat16_block_s < 60.0
    assert hardware.cpu_probe() == raised
    assert _counted(cache) == {**dataclasses.asdict(raised), "agreeing": 1, "measured": hardware.SETTLED + 1}


def test_the_next_runs_measure_again_until_their_peaks_agree(cache: Path) -> None:
    """One run's rounds all share the load it started under, so a peak first measured on a busy machine would
    stay low for good: each later run (a process of its own) measures once more until SETTLED runs agree."""
    low = LOW
    _store(cache, agreeing=1, measured=1, **low)
    probe = hardware.cpu_probe()
    assert probe.peak_flops > 2e8 and probe.float32_block_s < 50.0  # the next run measured it again
    assert _counted(cache) == {
        **dataclasses.asdict(probe),
        "agreeing": 1,
        "measured": 2,
    }  # the low one disagrees
    hardware.forget_probe()  # another run
    assert hardware.cpu_probe().peak_flops >= probe.peak_flops and _entry(cache)["measured"] == 3
    assert hardware.settle_probe() and _cached_counts(cache)[1] <= hardware.MAX_MEASUREMENTS
    assert hardware.Cached(CpuProbe(**_figures(cache)), *_cached_counts(cache)).settled()
    _store(cache, **low)  # settled: read as it is, whatever it holds
    hardware.forget_probe()
    assert hardware.cpu_probe() == CpuProbe(**low) and _entry(cache)["measured"] == hardware.SETTLED


def test_implausible_figures_are_measured_again_however_settled(cache: Path) -> None:
    """Figures no CPU measures (a peak of 5e287 or 0.5 FLOP/s, a dense layer many times faster than any
    matmul) are not trusted, settled or not: the next run measures again."""
    real = dict(float32_flops=1.3e11, bfloat16_flops=0.8e11, float32_block_s=0.074, bfloat16_block_s=0.078)
    _store(cache, **real)
    assert hardware.cached_probe() == hardware.Cached(CpuProbe(**real), hardware.SETTLED, hardware.SETTLED)
    for forged in (
        {"float32_flops": 5e287},
        {"float32_flops": 0.5, "bfloat16_flops": 0.4},
        {"float32_block_s": 1e-6},  # a dense layer at 6e15 FLOP/s on a 1.3e11 FLOP/s CPU
        {"bfloat16_block_s": 5e-3},  # 16x the peak
    ):
        _store(cache, **{**real, **forged})
        assert hardware.cached_probe() is None, forged
    probe = hardware.cpu_probe()
    assert probe.bfloat16_block_s != 5e-3
    assert _counted(cache) == {**dataclasses.asdict(probe), "agreeing": 1, "measured": 1}  # measured again


def test_auto_never_picks_bfloat16_where_its_matmul_is_the_slower(cache: Path) -> None:
    """A bfloat16 speed-up of the dense layer on a CPU that emulates bfloat16 (its matmul slower than
    float32's) is a measurement gone wrong or an edited cache: auto keeps float32 and says why."""
    _store(cache, float32_flops=1.3e11, bfloat16_flops=0.8e11, float32_block_s=0.074, bfloat16_block_s=0.05)
    dtype, why = compute_dtype("auto", "cpu")
    assert (
        dtype == "float32"
        and "1.48x as fast in bfloat16 as in float32 on this CPU, whose bfloat16 matmul" in why
    )


def test_measurements_agree_within_a_tenth_and_a_higher_peak_starts_the_count_again() -> None:
    def probe(peak: float) -> CpuProbe:
        return CpuProbe(
            float32_flops=peak, bfloat16_flops=peak / 2, float32_block_s=1.0, bfloat16_block_s=2.0
        )

    first = hardware.Cached(probe(100.0))
    assert first.adding(probe(95.0)) == hardware.Cached(probe(100.0), 2, 2)  # agrees
    assert first.adding(probe(80.0)) == hardware.Cached(probe(100.0), 1, 2)  # itself measured under load
    assert first.adding(probe(150.0)) == hardware.Cached(probe(150.0), 1, 2)  # the first was under load
    settled = first.adding(probe(95.0)).adding(probe(105.0))
    assert settled == hardware.Cached(probe(105.0), 3, 3) and settled.settled()
    busy = hardware.Cached(probe(100.0), 1, hardware.MAX_MEASUREMENTS - 1).adding(probe(50.0))
    assert busy.agreeing == 1 and busy.settled()  # an always-busy machine stops measuring after a few runs


def test_auto_picks_bfloat16_where_the_cpu_trains_a_dense_layer_faster_in_it(cache: Path) -> None:
    _store(cache, float32_flops=1e9, bfloat16_flops=5e9, float32_block_s=2.0, bfloat16_block_s=1.0)
    dtype, why = compute_dtype("auto", "cpu")
    assert dtype == "bfloat16" and "2.00x as fast in bfloat16" in why and str(cache) in why
    hardware.forget_probe()
    # A CPU without bf16 matrix units emulates it: slower, so nothing gets slower than float32.
    _store(cache, float32_flops=1e9, bfloat16_flops=0.5e9, float32_block_s=10.0, bfloat16_block_s=15.0)
    assert compute_dtype("auto", "cpu")[0] == "float32"
    assert compute_dtype("bfloat16", "cpu") == ("bfloat16", "--model.dtype bfloat16")


def test_auto_keeps_the_pick_of_a_machines_first_measurement(cache: Path) -> None:
    """Later rounds refine the peak, not the pick: a pick that followed them (load can tip a close one) would
    change the numbers between two runs, or two sessions of one run, on the same machine. An entry without a
    pick gets one from its figures; a bfloat16 pick that figures never made is measured again."""
    bf16_fast = dict(float32_flops=1e9, bfloat16_flops=5e9, float32_block_s=2.0, bfloat16_block_s=1.0)
    _store(cache, agreeing=1, measured=1, dtype="float32", speedup=0.9, **bf16_fast)
    dtype, why = compute_dtype("auto", "cpu")  # this run adds a round, whose figures say bfloat16
    assert dtype == "float32" and "0.90x as fast in bfloat16" in why
    assert _entry(cache)["dtype"] == "float32" and _entry(cache)["measured"] == 2
    hardware.forget_probe()
    _store(cache, **bf16_fast)  # an older minigpt's entry: no pick in it
    assert compute_dtype("auto", "cpu")[0] == "bfloat16" and _entry(cache)["dtype"] == "bfloat16"
    emulated = dict(float32_flops=1e9, bfloat16_flops=0.5e9, float32_block_s=10.0, bfloat16_block_s=15.0)
    _store(cache, dtype="bfloat16", speedup=2.0, **emulated)
    assert hardware.cached_probe() is None  # measured again


MEASURE = """
import json
from minigpt.training import hardware
print(json.dumps(hardware.compute_dtype("auto", "cpu")[0]))
"""


def test_processes_measuring_at_once_take_turns_and_agree_on_the_pick(tmp_path: Path) -> None:
    """The first runs on a machine, started together, measure one after the other (at once, each would slow
    the other's measurement down), and the second keeps the pick the first made."""
    env = subprocess_env(MINIGPT_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", MEASURE], stdout=subprocess.PIPE, text=True, env=env,
                              cwd=WORKDIR) for _ in range(2)]  # fmt: skip
    picks = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs) and picks[0] == picks[1]
    entry = json.loads((tmp_path / "machine.json").read_text())[hardware.host_key()]
    assert entry["measured"] == 2 and entry["dtype"] == picks[0]


def test_a_budget_reads_as_far_as_a_dense_layer_trains_in_the_runs_dtype(cache: Path) -> None:
    """How far a --max-time run may read is set by the rate this CPU trains a dense layer at in the run's
    dtype, not by its matmul peak (several times faster than any whole step, it would tokenize far more than
    the run reads); on an accelerator by its peak."""
    _store(cache, float32_flops=1e9, bfloat16_flops=5e9, float32_block_s=2.0, bfloat16_block_s=1.0)
    cpu, n = jax.devices("cpu")[0], len(jax.devices("cpu"))
    assert hardware.training_flops(cpu, "bfloat16") == pytest.approx(hardware.dense_block_flops() / 1.0 / n)
    assert hardware.training_flops(cpu, "float32") == pytest.approx(hardware.dense_block_flops() / 2.0 / n)
    assert hardware.training_flops(cpu, "float32", peak_tflops=2.0) == 2e12
    assert hardware.training_flops(H100, "float32") == pytest.approx(989e12)
