"""The profiler window and trace reading: only the window's steps are traced, each annotated with its step
number, and the share of step time in collectives is read back from a trace."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from minigpt.training.profiling import ProfileWindow, collective_share, trace_files

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


def step_events(trace: Path) -> dict[int, float]:
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
    window = ProfileWindow((2, 4), tmp_path)
    for step in range(6):
        x = window.run(step, f, x)
        assert window.active == (step == 2)  # started at 2, stopped right after 3
    window.close()
    (trace,) = trace_files(tmp_path)
    assert trace.stat().st_size > 0
    assert sorted(step_events(trace)) == [2, 3]
    assert window.traced_steps == [2, 3]
    # A run resumed past the window traces nothing; `None` never traces.
    late = ProfileWindow((2, 4), tmp_path / "late")
    for step in range(5, 8):
        late.run(step, f, x)
    assert not (tmp_path / "late").exists()
    assert ProfileWindow(None, tmp_path / "off").run(0, lambda a, b: a + b, 3, 4) == 7
