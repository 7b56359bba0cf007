"""`minigpt bench` and `minigpt profile`: the sweep's table and files, failed points as rows, readable traces; and
the benchmarks' results page, rendered from their JSON."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST_BACKEND_FLAGS, REPO, SHARED_DATA_VARIABLE, cli_error, need_shared, run_cli
from test_profiling import step_events

from minigpt.config import ConfigError, DataConfig, ModelConfig, TrainConfig, get_preset
from minigpt.tools.bench import all_layouts, bench_config, describe_error, parse_layout, profile

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
    steps = step_events(trace)
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
        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {FAST_BACKEND_FLAGS}"},
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


def test_bench_flags_are_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    err = cli_error(capsys, ["bench", *TINY_MODEL, "--layouts", "2x2", "--out", str(tmp_path)])
    assert err.startswith("minigpt: error: layout '2x2' must be DATAxFSDPxTENSOR")
    assert not any(tmp_path.iterdir())  # before any work: nothing written


def test_the_results_page_is_rendered_from_the_benchmarks_json(tmp_path: Path) -> None:
    """`python -m benchmarks --render-only` writes every table under the commit, date, machine and command that
    produced it, and one chosen headline per benchmark into the README's results block (the CI machine kind's
    record, not another machine's), from the JSON alone; every headline stays on the results page."""
    record = {
        "name": "bench_speed", "title": "A fixture", "quick": False,
        "code": {"commit": "0123456789abcdef", "modified": []}, "date": "2025-01-02 03:04 UTC",
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 23.5, "accelerator": "none"},
        "command": "python benchmarks/bench_speed.py --out benchmarks/results",
        "tables": [{"title": "", "columns": ["side", "tokens/s"], "rows": [["minigpt", "1,234"]], "note": "n"}],
        "headlines": ["the cpu preset does 9 tokens/s", "The tutorial preset at batch 48 does 1,234 tokens/s"],
        "data": None,
    }  # fmt: skip
    results = tmp_path / "results"
    results.mkdir()
    (results / "bench_speed.json").write_text(json.dumps(record))
    other = {**record, "name": "bench_speed_avx2", "headlines": ["The tutorial preset at batch 48 on avx2"]}
    (results / "bench_speed_avx2.json").write_text(json.dumps(other))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:begin -->\nold line\n<!-- results:end -->\nrest\n")
    page = tmp_path / "docs" / "results.md"
    cmd = [sys.executable, "-m", "benchmarks", "--render-only", "--out", str(results)]
    subprocess.run(
        [*cmd, "--docs", str(page), "--readme", str(readme)], cwd=REPO, check=True, capture_output=True
    )
    section = page.read_text().split('<a id="bench_speed"></a>')[1]
    assert section.splitlines()[1:6] == [
        "## A fixture",
        "",
        "- commit: `minigpt 0123456`, 2025-01-02 03:04 UTC",
        "- machine: Test CPU, 2 cores, 23.5 GiB, no accelerator",
        "- command: `python benchmarks/bench_speed.py --out benchmarks/results`",
    ]
    assert "| side | tokens/s |\n|---|---:|\n| minigpt | 1,234 |" in section
    text = readme.read_text()
    assert text.startswith("intro\n<!-- results:begin -->\n") and text.endswith(
        "<!-- results:end -->\nrest\n"
    )
    block = text.splitlines()[2:-2]
    assert (
        "- The tutorial preset at batch 48 does 1,234 tokens/s ([how](docs/results.md#bench_speed))" in block
    )
    assert not any("avx2" in line or "9 tokens/s" in line or "old line" in line for line in block), block
    assert len(block) <= 10  # one line per claim: the published records' other benchmarks fill the rest


def test_a_second_machines_record_sits_beside_the_first_and_names_its_cpu(tmp_path: Path) -> None:
    """--machine-tag writes NAME_TAG.json, so a run on another machine adds a section instead of replacing the
    published one (its section right after the first's), and its title and README headlines say which CPU
    measured them."""
    import argparse

    from benchmarks.common import machine, write_result
    from benchmarks.report import rank

    table = {"title": "", "columns": ["side", "tokens/s"], "rows": [["minigpt", "1"]]}
    for tag in ("", "avx2"):
        args = argparse.Namespace(quick=False, out=str(tmp_path), machine_tag=tag)
        write_result(args, "fixture_bench", "A fixture", [table], headlines=["minigpt does 1 tokens/s"])
    plain = json.loads((tmp_path / "fixture_bench.json").read_text())
    tagged = json.loads((tmp_path / "fixture_bench_avx2.json").read_text())
    where = f" on {machine()['cpu']} (avx2)"
    assert (plain["name"], plain["title"], plain["headlines"]) == (
        "fixture_bench", "A fixture", ["minigpt does 1 tokens/s"]
    )  # fmt: skip
    assert (tagged["name"], tagged["title"], tagged["headlines"]) == (
        "fixture_bench_avx2", "A fixture" + where, ["minigpt does 1 tokens/s" + where]
    )  # fmt: skip
    names = ["bench_speed_avx2", "fixture_bench", "bench_speed", "time_to_quality_small", "time_to_quality"]
    assert sorted(names, key=rank) == [
        "time_to_quality", "time_to_quality_small", "bench_speed", "bench_speed_avx2", "fixture_bench"
    ]  # fmt: skip


def test_a_record_made_on_an_accelerator_is_tagged_with_its_kind() -> None:
    """bench_generate on a TPU must not write over the CPU's bench_generate.json: an accelerator's record is
    tagged with the device kind unless a tag is given; a CPU's stays untagged."""
    from benchmarks.common import machine_tag, record_tag

    tpu = {"cpu": "unknown CPU", "accelerator": "1 x TPU v5 lite"}
    assert record_tag("", tpu) == "tpu-v5-lite" == machine_tag(record_tag("", tpu))
    assert record_tag("", {"accelerator": "8 x NVIDIA H100 80GB HBM3"}) == "nvidia-h100-80gb-hbm3"
    assert record_tag("v5e", tpu) == "v5e"
    assert record_tag("", {"cpu": "AMD EPYC", "accelerator": "none"}) == ""


def test_a_machine_tag_that_is_not_a_plain_name_is_refused_in_one_line(capsys: pytest.CaptureFixture) -> None:
    """The tag names a file beside the published records: '../x' or 'a b' would write elsewhere or break
    the page's anchor, so the flag refuses it before any measuring."""
    from benchmarks.common import parser

    for bad in ("../avx2", "avx 2", "a_b"):
        with pytest.raises(SystemExit):
            parser("doc").parse_args(["--machine-tag", bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith(f"argument --machine-tag: {bad!r} must be letters, digits or '-' (it names "
                            "NAME_TAG.json)")  # fmt: skip
    assert parser("doc").parse_args(["--machine-tag", "zen4-avx512"]).machine_tag == "zen4-avx512"


SMALL = "--model.n-layers 1 --model.d-model 64 --model.d-ff 128"
"""What --parallel is checked with: a small model is enough to see two runs pinned and overlapping."""


@pytest.mark.skipif(
    shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2, reason="needs taskset and two cores"
)
def test_time_to_quality_parallel_trains_one_run_per_core_at_once(tmp_path: Path) -> None:
    """`time_to_quality.py --parallel`: the variants train at the same time, each in its own process pinned to
    its own core, and land in one record."""
    cores = [str(c) for c in sorted(os.sched_getaffinity(0))[:2]]
    cmd = [sys.executable, "benchmarks/time_to_quality.py", "--quick", "--out", str(tmp_path), "--parallel",
           "--cores", ",".join(cores), "--variant", f"a={SMALL}", "--variant", f"b={SMALL} --seed 1"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    pins = [line.split()[3] for line in out.stdout.splitlines() if line.startswith("$ taskset -c ")]
    assert sorted(pins) == cores
    runs = json.loads((tmp_path / "time_to_quality.json").read_text())["data"]["results"]
    assert sorted(r["variant"] for r in runs) == ["a", "b"]
    assert max(r["started"] for r in runs) < min(r["started"] + r["wall_s"] for r in runs)  # they overlapped


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the repository's git history")
def test_bench_speed_measures_a_baseline_commit_from_its_own_code(tmp_path: Path) -> None:
    """`bench_speed.py --baseline REV`: float32 as minigpt trained at REV (its src/ from git), as one more
    side with its ratio column; a name that is no commit is refused in one line before anything runs."""
    cmd = [sys.executable, "benchmarks/bench_speed.py", "--quick", "--out", str(tmp_path), "--baseline"]
    bad = subprocess.run([*cmd, "no-such-rev"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (
        bad.returncode != 0 and "--baseline no-such-rev: not a commit" in bad.stderr.strip().splitlines()[-1]
    )
    out = subprocess.run([*cmd, "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "bench_speed.json").read_text())
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert record["code"]["baseline_commit"] == head
    (speed,) = record["tables"]
    assert f"/ float32 at {head[:7]}" in speed["columns"]
    then = [row for row in speed["rows"] if row[1] == f"minigpt float32 at {head[:7]}"]
    assert len(then) == 1 and float(then[0][3].replace(",", "")) > 0


def test_the_suite_and_the_benchmarks_find_real_text_where_the_variable_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh clone has no `../shared/data`: $MINIGPT_SHARED_DATA points the real-data tests and the
    benchmarks at the folder, and where the text is absent the skip reason names the variable."""
    folder = tmp_path / "data"
    monkeypatch.setenv(SHARED_DATA_VARIABLE, str(folder))
    with pytest.raises(
        pytest.skip.Exception, match=f"set \\${SHARED_DATA_VARIABLE} to the shared data folder"
    ):
        need_shared("tinystories/train.txt", "real TinyStories text")
    (folder / "tinystories").mkdir(parents=True)
    (folder / "tinystories" / "train.txt").write_text("Once upon a time.\n")
    assert (
        need_shared("tinystories/train.txt", "real TinyStories text") == folder / "tinystories" / "train.txt"
    )
    code = "from benchmarks.common import SHARED, need; print(SHARED); need(SHARED / 'gpt2')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 75  # the runner's "skipped"
    assert out.stdout.splitlines()[0] == str(folder)
    assert f"{folder / 'gpt2'} is absent: set ${SHARED_DATA_VARIABLE} to the shared data folder" in out.stdout
