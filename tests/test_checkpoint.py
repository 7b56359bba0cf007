"""Checkpoints: exact resume after SIGKILL/SIGTERM, restore across meshes, NaN halts, damaged checkpoints,
unsafe config changes, a full disk, and parameter-only exports."""

from __future__ import annotations

import json
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    TINY_FLAGS,
    WORKDIR,
    cli_env,
    cli_error,
    run_cli,
    run_on_devices,
    start_cli,
)

from minigpt.training.metrics import read_metrics


def _flags(corpus: Path, cache: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), "--data.cache-dir", str(cache), *TINY_FLAGS, "--run-dir", str(run),
            "--log-every", "1", "--sample-tokens", "4", *extra]  # fmt: skip


def _losses(run: Path) -> dict[int, float]:
    """The last logged training loss of every step (a resumed run logs the replayed steps again)."""
    return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}


def _checkpoints(run: Path) -> list[int]:
    folder = run / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


KILL_STEPS = ["--steps", "40", "--ckpt-every", "5", "--eval-every", "1000"]
# For runs of a shape no other test compiles, where nothing reads the sample: no decoder to compile for it.
NO_SAMPLE = ["--sample-tokens", "0"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_run: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 40-step run never stopped: what both kill-and-resume tests must reproduce."""
    corpus, cache, _ = tiny_run
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    ref = run_cli(*_flags(corpus, cache, run, *KILL_STEPS))
    assert ref.returncode == 0, ref.stderr[-2000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_with_bitwise_identical_losses(
    tiny_run: tuple[Path, Path, Path], uninterrupted: Path, tmp_path: Path, sig: int
) -> None:
    corpus, cache, _ = tiny_run
    run = tmp_path / "run"
    kill_at = random.Random().randint(8, 30)
    proc = start_cli(*_flags(corpus, cache, run, *KILL_STEPS))
    for line in proc.stdout:
        at = int(line.split()[1].split("/")[0]) if line.startswith("step") and "/40" in line else 0
        if at >= kill_at and _checkpoints(run):
            proc.send_signal(sig)
            break
    rest, err = proc.communicate(timeout=300)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # graceful: finish the step, save, exit 0
        assert proc.returncode == 0, err[-2000:]
        assert "SIGTERM: finishing this step and saving a checkpoint" in err
        stopped = int(rest.split("stopped by SIGTERM at step ")[1].split(";")[0])
        assert stopped in _checkpoints(run)
        # It saves and exits: no evaluation or sample keeps the user waiting (only a run's end evaluates here).
        assert not [r for r in read_metrics(run) if r["kind"] == "val"]
        assert rest.strip().splitlines()[-1].startswith(f"the same command resumes it from step {stopped}")
    assert max(_losses(run)) < 40, "the run finished before the signal"

    resumed = run_cli(*_flags(corpus, cache, run, *KILL_STEPS))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from step" in resumed.stdout
    expected, got = _losses(uninterrupted), _losses(run)
    assert sorted(got) == list(range(1, 41))
    assert got == expected, f"killed at step >= {kill_at}: {[s for s in got if got[s] != expected[s]]}"


CROSS_MESH_WORKER = """
import dataclasses, json, tempfile
import jax
from minigpt.parallel import sharding
from minigpt.training.checkpoint import Checkpointer
from minigpt.config import DataConfig, MeshConfig, ModelConfig, TrainConfig
from minigpt.optim.optimizer import AdamW, ConstantSchedule
from minigpt.training.trainer import TrainState, build, init_state, make_train_step

cfg = TrainConfig(
    model=ModelConfig(vocab_size=500, max_seq_len=32, d_model=64, n_layers=2, n_heads=4, d_ff=128),
    data=DataConfig(seq_len=16), batch_size=8, optimizer=AdamW(), schedule=ConstantSchedule(warmup_steps=0, peak_lr=1e-3),
)
batch = jax.random.randint(jax.random.PRNGKey(0), (1, 8, 17), 0, 500)
run_dir = tempfile.mkdtemp()

def setup_for(d, f, t):
    c = dataclasses.replace(cfg, mesh=MeshConfig(data=d, fsdp=f, tensor=t, fsdp_min_mbytes=0))
    return build(c, jax.devices()[: d * f * t])

out = {}
fsdp = setup_for(1, 8, 1)
with sharding.set_mesh(fsdp.mesh):
    step = make_train_step(fsdp)
    state = init_state(fsdp)
    for _ in range(3):
        state, _ = step(state, batch, fsdp.cfg.steps)
    ckpt = Checkpointer(run_dir)
    ckpt.save(3, state.saved(), {"next_index": 0}, {})
    ckpt.close()
    out["fsdp8"] = float(step(state, batch, fsdp.cfg.steps)[1]["loss"])
for name, layout in {"one_device": (1, 1, 1), "data2_tensor2": (2, 1, 2)}.items():
    s = setup_for(*layout)
    ckpt = Checkpointer(run_dir)
    restored, _, _ = ckpt.restore(s.abstract_state.saved())
    restored = TrainState.restored(restored, average=False)
    ckpt.close()
    with sharding.set_mesh(s.mesh):
        out[name] = float(make_train_step(s)(restored, batch, s.cfg.steps)[1]["loss"])
    out[name + "_devices"] = len(restored.params["wte"][...].sharding.device_set)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_restore_onto_other_meshes_gives_the_same_next_step() -> None:
    out = run_on_devices(CROSS_MESH_WORKER)
    assert out["one_device_devices"] == 1 and out["data2_tensor2_devices"] == 4
    assert out["one_device"] == pytest.approx(out["fsdp8"], rel=1e-5)
    assert out["data2_tensor2"] == pytest.approx(out["fsdp8"], rel=1e-5)


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(small_corpus: Path, tmp_path: Path) -> None:
    # Plain SGD at learning rate 20 without clipping really diverges: finite but exploding, then NaN (with tied
    # embeddings, where the table gets the output layer's gradient too; untied, this run stays finite).
    diverge = ["--steps", "30", "--ckpt-every", "2", "--eval-every", "1000", "--model.tie-embeddings",
               "optimizer:sgd", "--optimizer.momentum", "0.9", "--optimizer.clip-gradient-norm", "inf",
               "schedule:constant-schedule",
               "--schedule.warmup-steps", "0", "--schedule.peak-lr", "20"]  # fmt: skip
    out = run_cli(*_flags(small_corpus, tmp_path / "cache", tmp_path / "run", *diverge))
    assert out.returncode == 1
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith("minigpt: error: ") and "became nan at step " in err, out.stderr[-2000:]
    bad_step = int(err.split("at step ")[1].split(";")[0])
    saved = _checkpoints(tmp_path / "run")
    assert saved and max(saved) < bad_step
    assert f"last good checkpoint (step {max(saved)}) is kept" in err
    ev = run_cli("eval", "--run", str(tmp_path / "run"))  # the kept checkpoint restores and evaluates
    assert ev.returncode == 0 and f"step {max(saved)} | val loss" in ev.stdout, ev.stderr[-2000:]
    assert "nan" not in ev.stdout


def _copy(tiny_run: tuple[Path, Path, Path], tmp_path: Path) -> Path:
    """A copy of the session's 4-step run (checkpoints at steps 2 and 4) to change."""
    return Path(shutil.copytree(tiny_run[2], tmp_path / "run"))


def test_a_run_turns_its_weight_average_on_or_off_when_resumed(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The session's run keeps a weight average (the cpu preset's); resumed with --average-weights 0 it drops
    it, and a checkpoint saved without one (so too an older minigpt's) resumes with one, started from its
    weights."""
    from minigpt.training.checkpoint import Checkpointer

    corpus, cache, _ = tiny_run
    run = _copy(tiny_run, tmp_path)
    more = ["--ckpt-every", "2", "--eval-every", "1000", "--keep-checkpoints", "9"]
    off = run_cli(*_flags(corpus, cache, run, "--steps", "6", "--average-weights", "0", *more))
    assert off.returncode == 0, off.stderr[-2000:]
    assert "resumed from step 4" in off.stdout and "the average" not in off.stdout
    on = run_cli(*_flags(corpus, cache, run, "--steps", "8", "--average-weights", "0.5", *more))
    assert on.returncode == 0, on.stderr[-2000:]
    assert "resumed from step 6" in on.stdout and "the average of steps 5-8's weights" in on.stdout
    ckpt = Checkpointer(run)
    held = {step: any(n.startswith("average.") for n in ckpt._saved_shapes(step)) for step in (4, 6, 8)}
    ckpt.close()
    assert held == {4: True, 6: False, 8: True}


def test_damaged_newest_checkpoint_is_set_aside_and_the_previous_used(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    corpus, cache, _ = tiny_run
    run = _copy(tiny_run, tmp_path)
    assert _checkpoints(run) == [2, 4]
    biggest = max(
        (p for p in (run / "checkpoints" / "4").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])  # truncated, as by a crash

    again = run_cli(*_flags(corpus, cache, run, "--steps", "6", "--ckpt-every", "2", "--eval-every", "1000"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "warning: checkpoint 4 is damaged" in again.stderr
    assert "resumed from step 2" in again.stdout
    assert _checkpoints(run) == [2, 4, 6]
    assert (run / "damaged-checkpoint-4").is_dir()


def test_eval_and_generate_skip_a_checkpoint_with_changed_bytes_and_training_resumes_before_it(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    corpus, cache, _ = tiny_run
    run = _copy(tiny_run, tmp_path)
    biggest = max((run / "checkpoints" / "4" / "state" / "ocdbt.process_0" / "d").iterdir(),
                  key=lambda p: p.stat().st_size)  # fmt: skip
    _flip(biggest, biggest.stat().st_size // 2, 2048)
    ev = run_cli("eval", "--run", str(run))
    assert ev.returncode == 0 and "step 2 | val loss" in ev.stdout, ev.stderr[-2000:]
    gen = run_cli("generate", "--run", str(run), "--prompt", "Tom", "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr[-2000:]
    for out in (ev, gen):
        assert "warning: checkpoint 4 is damaged" in out.stderr and "left in place" in out.stderr
    assert _checkpoints(run) == [2, 4]
    again = run_cli(*_flags(corpus, cache, run, "--steps", "4", "--ckpt-every", "2", "--eval-every", "1000"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from step 2" in again.stdout and (run / "damaged-checkpoint-4").is_dir()


def _flip(path: Path, offset: int, n: int = 16) -> None:
    """Overwrite `n` bytes of `path` at `offset` (clamped to the file) with bytes that surely differ."""
    data = bytearray(path.read_bytes())
    offset = min(offset, max(len(data) - n, 0))
    noise = random.Random(offset).randbytes(n)
    for i in range(offset, min(offset + n, len(data))):
        data[i] ^= noise[i - offset] | 1
    path.write_bytes(bytes(data))


def _restore(run: Path) -> tuple[int, list]:
    """(step, parameters as numpy arrays) of what training would resume `run` from (setting damage aside)."""
    import jax
    import numpy as np

    from minigpt.training.checkpoint import Checkpointer
    from minigpt.training.runs import inference_config, run_config
    from minigpt.training.trainer import build

    setup = build(inference_config(run_config(run), len(jax.devices())))
    ckpt = Checkpointer(run)
    state, _, _ = ckpt.restore(setup.abstract_state.saved())
    ckpt.close()
    return int(state["step"]), [np.asarray(x) for x in jax.tree.leaves(state["params"])]


def test_generate_and_eval_restore_the_parameters_without_the_optimizer_state(
    tiny_run: tuple[Path, Path, Path],
) -> None:
    """Their restore reads no optimizer state: onto a state with another optimizer (SGD's state has another
    structure than the run's AdamW state, which a full restore refuses) the parameters and step come back as
    training's restore gives them."""
    import dataclasses

    import jax
    import numpy as np

    from minigpt.config import ConfigError
    from minigpt.optim.optimizer import SGD
    from minigpt.training.checkpoint import Checkpointer
    from minigpt.training.runs import inference_config, run_config
    from minigpt.training.trainer import build

    run = tiny_run[2]
    step, params = _restore(run)
    cfg = inference_config(run_config(run), len(jax.devices()))
    setup = build(dataclasses.replace(cfg, optimizer=SGD()))
    ckpt = Checkpointer(run)
    got, got_step = ckpt.restore_params(setup.abstract_state)
    with pytest.raises(ConfigError, match="does not fit this config"):
        ckpt.restore(setup.abstract_state.saved(), set_aside=False)
    ckpt.close()
    assert got_step == step
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(params, jax.tree.leaves(got), strict=True))


def test_every_checkpoint_of_a_run_has_a_manifest_that_verifies(tiny_run: tuple[Path, Path, Path]) -> None:
    from minigpt.training.checkpoint import MANIFEST, verify

    for step in _checkpoints(tiny_run[2]):
        folder = tiny_run[2] / "checkpoints" / str(step)
        assert verify(folder), f"checkpoint {step} has no {MANIFEST}"
        recorded = json.loads((folder / MANIFEST).read_text())["files"]
        assert any(name.startswith("state/ocdbt.process_0/d/") for name in recorded)


def _edit_manifest(step_dir: Path, change) -> None:
    from minigpt.training.checkpoint import MANIFEST

    manifest = json.loads((step_dir / MANIFEST).read_text())
    change(manifest)
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def _with_file(name: str, digest: str = "0" * 64):
    return lambda m: m["files"].update({name: digest})


MANIFEST_DAMAGE = {
    "files null": (lambda m: m.update(files=None), "not a mapping of names to sha256 digests"),
    "files a list": (lambda m: m.update(files=["_CHECKPOINT_METADATA"]), "not a mapping of names"),
    "files empty": (lambda m: m.update(files={}), "is not recorded in its manifest"),
    "unknown version": (lambda m: m.update(version=7), "not a version 1 sha256 manifest"),
    "unknown algorithm": (lambda m: m.update(algorithm="md5"), "not a version 1 sha256 manifest"),
    "not an object": (lambda m: m.clear(), "not a version 1 sha256 manifest"),
    "a device": (_with_file("/dev/zero"), "/dev/zero is missing"),
    "outside the step": (_with_file("../../config.json"), "../../config.json is missing"),
    "a digest not hex": (_with_file("_CHECKPOINT_METADATA", "z" * 64), "not a mapping of names"),
}


@pytest.mark.parametrize("case", MANIFEST_DAMAGE)
def test_a_manifest_is_untrusted_input(tiny_run: tuple[Path, Path, Path], tmp_path: Path, case: str) -> None:
    """A manifest must be a known version and algorithm listing every file of the step, and only regular
    files inside it: anything else makes the step damaged in one line; nothing outside it is ever read."""
    from minigpt.training.checkpoint import CheckpointDamaged, verify

    step_dir = _copy(tiny_run, tmp_path) / "checkpoints" / "4"
    change, message = MANIFEST_DAMAGE[case]
    _edit_manifest(step_dir, change)
    with pytest.raises(CheckpointDamaged, match=re.escape(message)):
        verify(step_dir)


def test_a_fifo_in_a_step_folder_is_damage_not_a_hang(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A FIFO (or any file that is not a regular one) in the step folder, recorded in the manifest or not,
    is named as damage without being opened: reading it would wait forever."""
    import os

    from minigpt.training.checkpoint import CheckpointDamaged, verify

    step_dir = _copy(tiny_run, tmp_path) / "checkpoints" / "4"
    os.mkfifo(step_dir / "state" / "pipe")
    with pytest.raises(CheckpointDamaged, match="state/pipe is not recorded in its manifest"):
        verify(step_dir)
    _edit_manifest(step_dir, _with_file("state/pipe"))
    with pytest.raises(CheckpointDamaged, match="state/pipe is not a regular file"):
        verify(step_dir)
    (step_dir / "state" / "pipe").unlink()
    (step_dir / "state" / "pipe").symlink_to("/dev/zero")
    with pytest.raises(CheckpointDamaged, match="state/pipe is not a regular file"):
        verify(step_dir)


def test_changed_bytes_anywhere_in_the_newest_checkpoint_never_resume_from_it(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Bytes changed at several offsets of several array files (and of Orbax's own metadata files) of
    checkpoint 4: each time, the restore falls back to checkpoint 2's exact parameters, and sets 4 aside."""
    intact = _copy(tiny_run, tmp_path / "intact")
    shutil.rmtree(intact / "checkpoints" / "4")
    step, older = _restore(intact)
    assert step == 2
    arrays = sorted((tiny_run[2] / "checkpoints" / "4" / "state" / "ocdbt.process_0" / "d").iterdir(),
                    key=lambda p: p.stat().st_size)  # fmt: skip
    targets = [(f"state/ocdbt.process_0/d/{p.name}", at) for p in (arrays[0], arrays[len(arrays) // 2], arrays[-1])
               for at in (0, p.stat().st_size // 2, p.stat().st_size - 1)]  # fmt: skip
    targets += [("state/_METADATA", 100), ("state/ocdbt.process_0/manifest.ocdbt", 40), ("meta/metadata", 5),
                ("_CHECKPOINT_METADATA", 20)]  # fmt: skip
    for i, (name, offset) in enumerate(targets):
        run = _copy(tiny_run, tmp_path / str(i))
        _flip(run / "checkpoints" / "4" / name, offset)
        step, params = _restore(run)
        assert step == 2, f"resumed from a checkpoint with {name} changed at offset {offset}"
        assert all((a == b).all() for a, b in zip(params, older, strict=True))
        assert (run / "damaged-checkpoint-4").is_dir() and _checkpoints(run) == [2]
        assert "warning: checkpoint 4 is damaged" in capsys.readouterr().err


def test_a_checkpoint_is_set_aside_under_a_free_name_and_one_without_manifest_still_restores(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from minigpt.training.checkpoint import MANIFEST

    run = _copy(tiny_run, tmp_path)
    (run / "damaged-checkpoint-4").mkdir()  # set aside before, by an earlier session
    (run / "damaged-checkpoint-4.1").mkdir()
    _flip(run / "checkpoints" / "4" / "state" / "_sharding", 10)
    assert _restore(run)[0] == 2
    assert (run / "damaged-checkpoint-4.2" / "state").is_dir()
    assert "set aside as damaged-checkpoint-4.2" in capsys.readouterr().err
    (run / "checkpoints" / "2" / MANIFEST).unlink()  # as a checkpoint written before manifests were
    assert _restore(run)[0] == 2
    assert "note: checkpoint 2 has no manifest" in capsys.readouterr().err


def test_a_checkpoint_restored_without_a_manifest_is_never_called_the_last_good_one(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A run whose loss turns NaN names what it leaves behind: the checkpoint it resumed from is 'the last good
    checkpoint' only where its files matched its manifest; without one it may be the damage that made the NaN."""
    import jax
    import numpy as np

    from minigpt.app.hooks import StepMetrics
    from minigpt.training.checkpoint import MANIFEST, Checkpointer
    from minigpt.training.runs import inference_config, run_config
    from minigpt.training.trainer import build

    run = _copy(tiny_run, tmp_path)
    setup = build(inference_config(run_config(run), len(jax.devices())))
    for manifest in (True, False):
        if not manifest:
            (run / "checkpoints" / "4" / MANIFEST).unlink()
        ckpt = Checkpointer(run)
        ckpt.restore(setup.abstract_state.saved())
        metrics = StepMetrics(ckpt)
        metrics.add(5, {"loss": np.float32(np.nan), "grad_norm": np.float32(1.0)})
        with pytest.raises(FloatingPointError) as stop:
            metrics.take()
        ckpt.close()
        good = "The last good checkpoint (step 4) is kept"
        assert (good in str(stop.value)) == manifest, str(stop.value)
    assert str(stop.value).endswith(
        f"The newest checkpoint (step 4, in {run / 'checkpoints'}), which the run resumed from, has no manifest "
        f"to verify it against and may be damaged: `minigpt check {run}`"
    )


def test_resume_refuses_unsafe_config_changes_with_the_diff(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    corpus, cache, _ = tiny_run
    run = _copy(tiny_run, tmp_path)  # 4 steps, checkpoints at 2 and 4
    base = ["--steps", "4", "--ckpt-every", "2", "--eval-every", "1000"]
    # Refused before anything is compiled or restored: `minigpt train` in this process (exit 2, one line).
    err = cli_error(capsys, _flags(corpus, cache, run, *base, "--model.d-ff", "128", "--seed", "3"))
    assert "model.d_ff: 64 -> 128; seed: 0 -> 3" in err and "pass --overwrite to start that one again" in err
    # More steps (and bookkeeping) are safe: the run continues from its checkpoint.
    longer = run_cli(*_flags(corpus, cache, run, "--steps", "6", "--ckpt-every", "2", "--eval-every", "3"))
    assert longer.returncode == 0 and "resumed from step 4" in longer.stdout
    assert _checkpoints(run) == [2, 4, 6]
    fresh = run_cli(*_flags(corpus, cache, run, "--steps", "2", "--ckpt-every", "2", "--eval-every", "1000",
                            "--model.d-ff", "128", "--overwrite", *NO_SAMPLE))  # fmt: skip
    assert fresh.returncode == 0 and "resumed" not in fresh.stdout
    assert json.loads((run / "config.json").read_text())["model"]["d_ff"] == 128
    assert _checkpoints(run) == [2]


def _limit_file_size() -> None:  # runs in the child: files over 64 KiB fail with EFBIG, like a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_failing_save_is_loud_and_leaves_earlier_checkpoints_intact(
    small_corpus: Path, tmp_path: Path
) -> None:
    big = [
        "--model.d-model",
        "128",
        "--model.d-ff",
        "256",
        "--eval-every",
        "1000",
        "--ckpt-every",
        "2",
        *NO_SAMPLE,
    ]
    cache, run = tmp_path / "cache", tmp_path / "run"
    first = run_cli(*_flags(small_corpus, cache, run, "--steps", "2", *big))
    assert first.returncode == 0, first.stderr[-2000:]
    # The child reads the session's compilation cache but writes none: its writes would meet the size limit.
    env = cli_env(JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=str(2**62))
    cmd = [sys.executable, "-m", "minigpt.cli", *_flags(small_corpus, cache, run, "--steps", "4", *big)]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=WORKDIR, preexec_fn=_limit_file_size
    )
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("minigpt: error: saving the ") and "earlier checkpoints are intact" in last
    assert _checkpoints(run)[0] == 2
    ev = run_cli("eval", "--run", str(run))
    assert ev.returncode == 0 and "step 2 | val loss" in ev.stdout, ev.stderr[-2000:]


def test_export_is_one_file_that_generate_and_eval_accept(
    tiny_run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tiny_run[2]  # only read
    out = tmp_path / "model.npz"
    exp = run_cli("export", "--run", str(run), "--out", str(out))
    assert exp.returncode == 0 and out.is_file(), exp.stderr[-2000:]
    assert "exists; pass --overwrite" in cli_error(capsys, ["export", "--run", str(run), "--out", str(out)])
    gen = ["--prompt", "Tom saw", "--max-new-tokens", "8", "--temperature", "0"]
    from_run = run_cli("generate", "--run", str(run), *gen)
    from_export = run_cli("generate", "--run", str(out), *gen)
    assert from_run.returncode == 0 and from_export.returncode == 0, from_export.stderr[-2000:]
    text = from_run.stdout  # all of it, through a pipe
    assert text.startswith("Tom saw") and text.endswith("\n"), text
    assert from_run.stdout == from_export.stdout
    ev_run, ev_export = run_cli("eval", "--run", str(run)), run_cli("eval", "--run", str(out))
    assert ev_run.stdout == ev_export.stdout and "step 4 | val loss" in ev_export.stdout


def test_keeps_the_newest_checkpoints_and_the_best(small_corpus: Path, tmp_path: Path) -> None:
    # lr rises steeply after step 2 so later checkpoints are worse: the best (step 2) must survive pruning.
    flags = ["--steps", "10", "--ckpt-every", "2", "--eval-every", "2", "--keep-checkpoints", "2",
             "optimizer:sgd", "--optimizer.momentum", "0", "--optimizer.clip-gradient-norm", "inf",
             "schedule:constant-schedule", "--schedule.warmup-steps", "0", "--schedule.peak-lr", "0.5"]  # fmt: skip
    out = run_cli(*_flags(small_corpus, tmp_path / "cache", tmp_path / "run", *flags))
    assert out.returncode == 0, out.stderr[-2000:]
    val = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "val"}
    best = min(val, key=val.get)
    assert _checkpoints(tmp_path / "run") == sorted({best, 8, 10})
