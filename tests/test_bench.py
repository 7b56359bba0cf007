"""`minigpt bench` and `minigpt profile`: the sweep's table and files, failed points as rows, readable traces."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import run_cli

from minigpt.bench import (
    ProfileWindow,
    all_layouts,
    bench_config,
    collective_share,
    describe_error,
    parse_layout,
    parse_profile_steps,
    profile,
    trace_files,
)
from minigpt.config import ConfigError, DataConfig, ModelConfig, TrainConfig, get_preset

TINY_MODEL = ["--model.d-model", "32", "--model.n-heads", "4", "--model.n-layers", "1", "--model.d-ff", "64",
              "--model.max-seq-len", "32", "--data.seq-len", "16", "--vocab-size", "300"]  # fmt: skip


def test_layouts_are_every_factorization_and_parse_strictly() -> None:
    layouts = all_layouts(8)
    assert len(layouts) == 10 and len(set(layouts)) == 10
    assert all(d * f * t == 8 for d, f, t in layouts)
    assert layouts[0] == (8, 1, 1) and (1, 1, 8) in layouts and (2, 2, 2) in layouts
    assert all_layouts(1) == [(1, 1, 1)]
    assert parse_layout("4x1x2") == (4, 1, 2)
    for bad in ("4x2", "4x0x2", "ax1x1", "4*1*2"):
        with pytest.raises(ConfigError, match="DATAxFSDPxTENSOR"):
            parse_layout(bad)
    assert parse_profile_steps("10:15") == (10, 15)
    for bad in ("10", "5:5", "7:3", "a:b"):
        with pytest.raises(ConfigError, match="START:END"):
            parse_profile_steps(bad)


def test_vocabulary_defaults_to_the_presets_tokenizer() -> None:
    assert bench_config(get_preset("cpu")).model.vocab_size == 4096
    assert bench_config(get_preset("gpt2-124m")).model.vocab_size == 50257
    assert bench_config(get_preset("tutorial"), vocab_size=1000).model.vocab_size == 1000


def test_errors_become_one_line_reasons() -> None:
    assert describe_error(ConfigError("mesh.tensor=8 does not divide model.n_heads=4")) == (
        "mesh.tensor=8 does not divide model.n_heads=4"
    )
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.\nmore detail")
    assert (
        describe_error(oom)
        == "out of memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB."
    )
    assert describe_error(ValueError("\n  bad shape\nx")) == "ValueError: bad shape"


SYNTHETIC_TRACE = """
planes {
  id: 1
  name: "/host:CPU"
  lines { id: 1 name: "python" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 10000000 }
    events { metadata_id: 1 offset_ps: 10000000 duration_ps: 10000000 } }
  lines { id: 2 name: "tf_XLAPjRtCpuClient/1" timestamp_ns: 1000
    events { metadata_id: 2 offset_ps: 1000000 duration_ps: 2000000 }
    events { metadata_id: 3 offset_ps: 2000000 duration_ps: 2000000 }
    events { metadata_id: 4 offset_ps: 5000000 duration_ps: 1000000 } }
  lines { id: 3 name: "tf_XLAEigen/2" timestamp_ns: 1000
    events { metadata_id: 4 offset_ps: 0 duration_ps: 1000000 }
    events { metadata_id: 2 offset_ps: 12000000 duration_ps: 1000000 } }
  lines { id: 4 name: "python-helper" timestamp_ns: 1000
    events { metadata_id: 2 offset_ps: 0 duration_ps: 9000000 } }
  event_metadata { key: 1 value { id: 1 name: "train" } }
  event_metadata { key: 2 value { id: 2 name: "all-reduce.1" } }
  event_metadata { key: 3 value { id: 3 name: "all-gather.2" } }
  event_metadata { key: 4 value { id: 4 name: "fusion.3" } }
}
"""


def test_collective_share_sums_collectives_over_the_cpu_worker_threads() -> None:
    """Two steps of 10 us on 2 devices. XLA's CPU worker threads ran 1..3 us of all-reduce overlapping 2..4 us
    of all-gather (3 us, counted once) and another 1 us all-reduce: 4 us of 2 x 20 us. Threads that are not
    XLA's workers do not count."""
    trace = jax.profiler.ProfileData.from_text_proto(SYNTHETIC_TRACE)
    assert collective_share(trace, n_devices=2) == pytest.approx(0.1)
    assert collective_share(trace, n_devices=1) == 0.0
    no_steps = jax.profiler.ProfileData.from_text_proto(SYNTHETIC_TRACE.replace('name: "train"', 'name: "x"'))
    assert collective_share(no_steps, n_devices=2) is None


def _step_events(trace: Path) -> dict[int, float]:
    """step_num -> duration (ns) of the StepTraceAnnotation("train") events of an .xplane.pb."""
    data = jax.profiler.ProfileData.from_file(str(trace))
    steps = {}
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                if e.name == "train":
                    stats = dict(e.stats)
                    steps[int(stats["step_num"])] = e.duration_ns
    return steps


def test_profile_window_traces_only_its_steps(tmp_path: Path) -> None:
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    window = ProfileWindow("2:4", tmp_path)
    for step in range(6):
        x = window.run(step, lambda x=x: f(x))
        assert window.active == (step == 2)  # started at 2, stopped right after 3
    window.close()
    (trace,) = trace_files(tmp_path)
    assert trace.stat().st_size > 0
    assert sorted(_step_events(trace)) == [2, 3]
    assert window.traced_steps == [2, 3]
    # A run resumed past the window traces nothing; `None` never traces.
    late = ProfileWindow((2, 4), tmp_path / "late")
    for step in range(5, 8):
        late.run(step, lambda: f(x))
    assert not (tmp_path / "late").exists()
    assert ProfileWindow(None, tmp_path / "off").run(0, lambda: 7) == 7


@pytest.mark.slow
def test_profile_writes_a_trace_that_profilers_can_read(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The .xplane.pb lands where TensorBoard's profile plugin and XProf look (LOGDIR/plugins/profile/RUN/),
    parses as an XSpace (jaxlib's reader, no TensorFlow), and holds one "train" step per traced step. Where
    xprof is installed, its converter (what `xprof`/`tensorboard --logdir` run) must accept it too."""
    cfg = TrainConfig(
        model=ModelConfig(vocab_size=300, max_seq_len=16, d_model=32, n_layers=1, n_heads=2, d_ff=64),
        data=DataConfig(seq_len=16),
        batch_size=4,
    )
    trace = profile(cfg, tmp_path, warmup_steps=1, trace_steps=2)
    assert trace.parent.parent == tmp_path / "plugins" / "profile" and trace.name.endswith(".xplane.pb")
    steps = _step_events(trace)
    assert sorted(steps) == [1, 2] and all(d > 0 for d in steps.values())
    out = capsys.readouterr().out
    assert f"tensorboard --logdir={tmp_path}" in out and f"xprof --logdir={tmp_path}" in out
    assert str(trace) in out
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        return
    data, _ = raw_to_tool_data.xspace_to_tool_data([str(trace)], "overview_page", {})
    assert b"train 1" in data and b"train 2" in data


@pytest.mark.slow
def test_bench_sweep_on_8_devices_writes_table_csv_json_and_plots_with_failed_points_as_rows(
    tmp_path: Path,
) -> None:
    out = run_cli(
        "bench", *TINY_MODEL, "--batch-sizes", "8", "16", "--layouts", "8x1x1", "2x2x2", "1x1x8",
        "--warmup-steps", "1", "--timed-steps", "2", "--out", str(tmp_path),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| layout (data x fsdp x tensor) | batch |") and "MFU" in table[0]
    assert len(table) == 2 + 6
    failed = [line for line in table if "failed:" in line]
    assert len(failed) == 2 and all(line.startswith("| 1x1x8 |") for line in failed)
    assert "mesh.tensor=8 does not divide model.n_heads=4" in failed[0]

    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["layout"], r["batch_size"], r["status"]) for r in rows] == [
        ("8x1x1", "8", "ok"), ("8x1x1", "16", "ok"), ("2x2x2", "8", "ok"), ("2x2x2", "16", "ok"),
        ("1x1x8", "8", "failed"), ("1x1x8", "16", "failed"),
    ]  # fmt: skip
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["meta"]["devices"] == 8 and result["meta"]["peak_tflops_per_device"] > 0
    for p in result["points"]:
        if p["status"] == "failed":
            assert p["error"] and p["step_ms"] is None and p["tokens_per_s"] is None
            continue
        assert p["devices"] == 8 and p["tokens_per_step"] == p["batch_size"] * 16
        assert p["compile_s"] > 0 and p["step_ms_min"] <= p["step_ms"]
        assert p["tokens_per_s"] == pytest.approx(p["tokens_per_step"] / (p["step_ms"] / 1e3))
        assert p["ms_per_sample"] == pytest.approx(p["step_ms"] / p["batch_size"])
        assert 0 < p["mfu"] < 1 and p["xla_mem_mib"] > 0
        assert p["peak_mem_mib"] is None  # the CPU backend reports no memory stats
        assert 0 < p["collectives"] <= 1  # 8 devices exchange gradients every step
    import matplotlib.pyplot as plt

    for name in ("tokens_per_s.png", "mfu.png"):
        image = plt.imread(tmp_path / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert (tmp_path / "bench.md").read_text().splitlines() == table


def test_bench_flags_are_checked_before_any_work(tmp_path: Path) -> None:
    out = run_cli("bench", *TINY_MODEL, "--layouts", "2x2", "--out", str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().startswith("minigpt: error: layout '2x2' must be DATAxFSDPxTENSOR")
