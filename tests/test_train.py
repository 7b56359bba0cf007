"""The training loop: the default preset's losses are pinned, the cpu preset learns real text, and each
periodic piece (clock, hooks, the NaN guard) does its job alone."""

from __future__ import annotations

import dataclasses
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import OPTIMISED, TINY_FLAGS, run_cli, start_cli

from minigpt.app.hooks import BudgetHook, Clock, Hook, LogHook, Progress, StepMetrics, StopHook, StopRequest
from minigpt.app.train import train
from minigpt.config import PRESETS
from minigpt.config.codec import load_json
from minigpt.training.metrics import read_metrics


@pytest.mark.slow
def test_cpu_preset_val_bits_per_byte_falls(tinystories: Path, cache_dir: str, tmp_path: Path) -> None:
    from minigpt.data.tokenizer import EOT
    from minigpt.training.metrics import read_metrics

    text = (tinystories / "train.txt").read_text()  # its first 400 kB, more than 40 steps read
    (tmp_path / "train.txt").write_text(text[: text.index(EOT, 400_000) + len(EOT)] + "\n")
    out = run_cli("train", "--preset", "cpu", "--data", str(tmp_path / "train.txt"), "--val-data",
                  str(tinystories / "valid.txt"), "--data.cache-dir", cache_dir, "--run-dir", str(tmp_path / "run"),
                  "--data.bpe-train-bytes", "400000",  # the BPE learns from all of it: the time goes to training
                  "--steps", "40", "--batch-size", "8", "--eval-every", "20", "--eval-batches", "8",
                  "--log-every", "10", "--sample-tokens", "0", env=OPTIMISED)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    val = [r["bpb"] for r in read_metrics(tmp_path / "run") if r["kind"] == "val"]
    assert len(val) == 2
    assert val[1] < val[0] < 3.5, val
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000


PINNED = {  # dtype: (rtol, every (train losses, validation losses) recorded for it)
    "float32": (1e-5, [([5.7431559562683105, 5.193719387054443, 4.740930080413818, 4.292300701141357,
                         3.730123281478882, 3.3392131328582764], [4.294809818267822, 2.945160388946533])]),
    # bfloat16 products with float32 accumulation on one CPU device, where XLA:CPU runs them in its fast
    # library. The summation order follows the library's kernels for the CPU's instructions and the tests'
    # compile flags (conftest), so each kind of CPU has its own record: an Intel Xeon with AMX, and an AMD
    # EPYC with AVX2 (no bf16 instructions: the library converts).
    "bfloat16": (1e-4, [
        ([5.743406772613525, 5.193825721740723, 4.741013526916504, 4.292438507080078, 3.7303905487060547,
          3.3402087688446045], [4.295140743255615, 2.94757342338562]),
        ([5.7433929443359375, 5.193839073181152, 4.741130828857422, 4.29270076751709, 3.730870008468628,
          3.340627431869507], [4.295347690582275, 2.9471449851989746]),
    ]),
}  # fmt: skip


def _pinned_recipe():
    """The cpu preset as it was when these losses were recorded (AdamW, WSD over 600 steps), spelled out so
    that a change of the preset's recipe does not move the pin."""
    from minigpt.config import ModelConfig, TrainConfig
    from minigpt.optim.optimizer import AdamW, WSDSchedule

    model = ModelConfig(
        max_seq_len=256, d_model=256, n_layers=4, n_heads=4, d_ff=1024, norm="rmsnorm", position="rope",
        activation="relu2", qk_norm=True, bias=False, tie_embeddings=True, dtype="float32",
    )  # fmt: skip
    schedule = WSDSchedule(warmup_steps=30, peak_lr=3e-3, total_steps=600, decay_fraction=0.3)
    return TrainConfig(model=model, optimizer=AdamW(weight_decay=0.1), schedule=schedule, batch_size=8)


@pytest.mark.parametrize("dtype", list(PINNED))
def test_losses_of_a_fixed_recipe_are_pinned(
    small_corpus: Path, tmp_path: Path, dtype: str, bf16_fast_path: bool
) -> None:
    """Every step's loss of a short fixed-seed run, in float32 (recorded before the training module was
    reshaped) and in mixed precision: a refactor of the loop, the step, the schedule or the data path must
    not change a single number. Where the CPU has no fast bfloat16 path, whose summation order no record
    here follows, mixed precision's losses are float32's to within 0.2%."""
    from minigpt.config import DataConfig
    from minigpt.training.metrics import read_metrics

    data = DataConfig(
        paths=(str(small_corpus),), seq_len=128, tokenizer="bpe", bpe_vocab_size=300,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    recipe = _pinned_recipe()
    cfg = dataclasses.replace(
        recipe, run_dir=str(tmp_path / "run"), data=data, steps=6, log_every=1, eval_every=3,
        ckpt_every=3, sample_tokens=8, model=dataclasses.replace(recipe.model, dtype=dtype),
    )  # fmt: skip
    train(cfg)
    rows = read_metrics(tmp_path / "run")
    got = ([r["loss"] for r in rows if r["kind"] == "train"], [r["loss"] for r in rows if r["kind"] == "val"])
    rtol, records = PINNED[dtype]
    if dtype == "bfloat16" and not bf16_fast_path:  # XLA emulates bfloat16 here: float32's losses, to 0.2%
        rtol, records = 2e-3, PINNED["float32"][1]
    same = lambda a, b: len(a) == len(b) and np.allclose(a, b, rtol=rtol, atol=0)
    assert any(same(got[0], t) and same(got[1], v) for t, v in records), (got, records)


# ---- the pieces, one at a time ----


def test_clock_leaves_pauses_out_of_training_time() -> None:
    clock = Clock()
    time.sleep(0.05)
    with clock.pause(state=None):
        during = clock.train_time()
        time.sleep(0.2)
        assert clock.train_time() == during  # a pause in progress does not count
    after = clock.train_time()
    assert 0.04 < after < 0.15, after
    assert clock.wall_time() - after == pytest.approx(clock.paused_s, abs=1e-3) and clock.paused_s >= 0.2


def test_a_hook_runs_every_n_steps_and_on_the_last() -> None:
    class Count(Hook):
        every = 3

    p = Progress(step=0, state=None, end=8)
    due = []
    for step in range(1, 9):
        p.step, p.final = step, step == 8
        due.append(Count().due(p))
    assert due == [False, False, True, False, False, True, False, True]


def test_a_ctrl_c_before_the_first_step_stops_at_once_and_after_it_finishes_the_step() -> None:
    """Before the session has taken a step nothing is left to save, and finishing the step would first wait
    for its compile: Ctrl-C stops at once (as anywhere before training). After one, it finishes the step and
    saves. With several processes (not `at_once`) every Ctrl-C is the agreed stop."""
    clock = Clock()
    with StopRequest(at_once=True) as stop:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert stop.signal_name is None
        StopHook(1, stop, clock, max_time=0.0)(Progress(step=1, state=None, end=10))  # after the first step
        signal.raise_signal(signal.SIGINT)
        assert stop.signal_name == "SIGINT"
    with StopRequest() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.signal_name == "SIGINT"


def test_ctrl_c_while_the_first_step_compiles_leaves_at_once_without_a_plot(
    small_corpus: Path, tmp_path: Path
) -> None:
    """`minigpt train` interrupted while its train step compiles (an empty compilation cache): it stops at
    once, with one line and status 130, no checkpoint and no loss plot. (Should the step be taken before the
    Ctrl-C lands, it stops as after any step: it saves, and still draws no plot: the next session does.)"""
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    proc = start_cli("train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"), *TINY_FLAGS,
                     "--run-dir", str(tmp_path / "run"), "--steps", "20", "--model.dtype", "float32",
                     "--peak-tflops", "1", env=env)  # fmt: skip
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("compiling the train and eval steps"):
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=300)
    assert "Traceback" not in err and not (tmp_path / "run" / "loss.png").exists(), err[-3000:]
    if proc.returncode == 130:
        assert err.strip().splitlines()[-1] == "minigpt: interrupted"
        assert not list((tmp_path / "run" / "checkpoints").glob("[0-9]*"))
    else:
        assert proc.returncode == 0 and "stopped by SIGINT at step 1; writing its checkpoint" in rest, err[
            -3000:
        ]


def test_stop_hook_ends_the_run_on_a_signal_or_the_time_limit() -> None:
    clock, stop = Clock(), StopRequest()
    p = Progress(step=4, state=None, end=10)
    StopHook(1, stop, clock, max_time=0.0)(p)
    assert not p.final and p.stop_message is None
    StopHook(1, stop, clock, max_time=1e-9)(p)
    assert p.final and p.stop_message == "stopping at step 4: max_time 0s reached"
    p = Progress(step=7, state=None, end=10)
    stop.signal_name = "SIGTERM"
    hook = StopHook(5, stop, clock, max_time=0.0)
    assert not hook.due(p)  # with several processes the stop is agreed only every `every` steps
    p.step = 10
    assert hook.due(p)
    hook(p)
    assert p.final and p.stop_message == "stopped by SIGTERM at step 10; writing its checkpoint"
    assert not hook.due(p)  # nothing left to decide on a final step


class _NoCheckpoints:
    def kept(self) -> str:
        return "The last good checkpoint (step 2) is kept in ckpts"


def test_step_metrics_refuse_a_non_finite_step_naming_it_and_the_last_good_checkpoint() -> None:
    metrics = StepMetrics(_NoCheckpoints())
    metrics.add(1, {"loss": np.float32(2.0), "grad_norm": np.float32(1.0)})
    metrics.add(2, {"loss": np.float32(np.nan), "grad_norm": np.float32(1.0)})
    with pytest.raises(
        FloatingPointError, match=r"loss became nan at step 2; .*checkpoint \(step 2\) is kept"
    ):
        metrics.take()
    assert len(metrics.pending) == 2  # nothing is consumed by a failed check


def test_log_hook_writes_the_window_mean_and_its_throughput(tmp_path: Path) -> None:
    from minigpt.training.metrics import MetricsWriter, read_metrics

    cfg = dataclasses.replace(PRESETS["cpu"], steps=10, batch_size=2, log_every=5)
    clock, metrics, writer = Clock(), StepMetrics(_NoCheckpoints()), MetricsWriter(tmp_path)
    hook = LogHook(5, cfg, metrics, clock, writer, peak=None, last_step=0)
    for step, loss in enumerate([4.0, 3.0, 2.0, 1.0, 0.0], start=1):
        metrics.add(step, {"loss": np.float32(loss), "grad_norm": np.float32(step), "lr": np.float32(0.1)})
    time.sleep(0.05)
    hook(Progress(step=5, state=None, end=10))
    writer.close()
    (record,) = read_metrics(tmp_path)
    assert record["step"] == 5 and record["loss"] == 2.0 and record["grad_norm"] == 5.0
    assert record["tokens_per_s"] == pytest.approx(5 * cfg.tokens_per_step / record["elapsed_s"], rel=0.05)
    assert "mfu" not in record and metrics.pending == [] and hook.last_step == 5


# ---- a time budget ----


def _budget_cfg(corpus: Path, run_dir: Path, dtype: str = "float32", **kw):
    from conftest import data_cfg

    from minigpt.config import ModelConfig, TrainConfig
    from minigpt.optim.optimizer import AdamW, WSDSchedule

    base = TrainConfig(
        run_dir=str(run_dir),
        model=ModelConfig(max_seq_len=16, d_model=32, n_layers=1, n_heads=2, d_ff=64, dtype=dtype),
        data=data_cfg(corpus, run_dir.parent / "cache", seq_len=16),
        optimizer=AdamW(),
        schedule=WSDSchedule(warmup_steps=20, peak_lr=1e-2, decay_fraction=0.5, shape="linear"),
        steps=100_000,
        batch_size=4,
        log_every=10,
        eval_every=0,
        ckpt_every=0,
        eval_batches=2,
        sample_tokens=4,
        max_epochs=0.0,  # the budget's own mechanics: 4 passes over this corpus would end these runs first
    )
    return dataclasses.replace(base, **kw)


def test_a_budget_times_its_step_only_where_that_tokenizes_less_of_the_corpus(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--max-time tokenizes only what the budget can read. A budget whose bound at the dense-block rate
    holds the whole corpus starts at once; a shorter one times the run's own step on random tokens first,
    and reads no more steps than STEP_MARGIN times that rate fits."""
    from minigpt.app.length import budget_steps, text_bytes

    cfg = _budget_cfg(small_corpus, tmp_path / "run", max_time=60.0)
    assert budget_steps(cfg) * cfg.tokens_per_step >= text_bytes(cfg.data) == small_corpus.stat().st_size
    assert "timing a training step" not in capsys.readouterr().out
    short = dataclasses.replace(cfg, max_time=1e-5)  # too short for a step: the bound is one step
    assert budget_steps(short) == 1
    assert "timing a training step to size the --max-time 1e-05s budget" in capsys.readouterr().out


def _stop_when_trained_past(run_dir: Path, step: int) -> None:
    """SIGTERM this process (the run saves and exits, as on a cluster's preemption) once metrics.jsonl shows
    the run past `step`."""
    import json
    import os
    import signal
    import threading

    def watch() -> None:
        while True:
            path = run_dir / "metrics.jsonl"
            lines = path.read_text().splitlines() if path.is_file() else []
            if any(json.loads(line)["step"] > step for line in lines):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()


class _SteppedClock(Clock):
    """Training time that moves only when the test says a step took so long."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def train_time(self) -> float:
        return self.now


def test_the_budget_is_laid_out_at_the_pace_the_run_settles_to() -> None:
    """The first steps after compiling run slower than the rest; the budget's pace comes from the later half of
    the steps timed, so the run still ends at its budget (a pace since the first step ended such runs early)."""
    p, end_s = _drifting_run(lambda step: 0.75 if step <= 40 else 0.5, 120.0)[:2]
    assert p.budgeted
    assert 119.0 < end_s <= 120.5, (p.end, end_s)


def test_a_short_slow_patch_before_the_layout_does_not_end_the_run_early() -> None:
    """A shared machine slows down for a while (20 steps at twice the time) shortly before the length is fixed
    at the decay's start: the median pace passes over it, and the run still ends within a second or two of its
    budget (the mean pace of the same steps ended it at 110.5 s of 120)."""
    p, end_s = _drifting_run(lambda step: 1.0 if 60 < step <= 80 else 0.5, 120.0)[:2]
    assert p.budgeted
    assert 118.5 < end_s <= 121.5, (p.end, end_s)


class _TickingClock(Clock):
    """Training time that moves on by a fixed tick each time it is read: the same at the same point of every
    run, whatever the machine's speed (the hooks read it a fixed number of times per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def train_time(self) -> float:
        self.now += 0.01
        return self.now


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_max_time_run_ends_decayed_and_resumes_bitwise(
    small_corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    capsys: pytest.CaptureFixture,
) -> None:
    """--max-time lays the run's length out from the measured step time and saves it: the run is stopped
    (SIGTERM) after the layout and resumed, ends with the learning rate at the end of its decay, and its
    parameters equal, bit for bit, an uninterrupted run of the laid-out length with no time limit (which also
    shows --eval-every 0 / --ckpt-every 0: one evaluation and one checkpoint, at the end)."""
    from minigpt.training.checkpoint import Checkpointer
    from minigpt.training.metrics import read_metrics
    from minigpt.training.runs import load_model

    # The weight average starts a tenth into the run, so the stop falls inside it: the checkpoint carries it on.
    budget = _budget_cfg(small_corpus, tmp_path / "budget", max_time=5.0, dtype=dtype, average_weights=0.9)
    # The length must not hang on the machine's speed: it is compared with a run of that length.
    monkeypatch.setattr("minigpt.app.train.Clock", _TickingClock)
    _stop_when_trained_past(tmp_path / "budget", 40)
    stopped = train(budget)["step"]
    resumed = train(budget)
    end = resumed["step"]
    assert 40 < stopped < end, (stopped, end)
    last = [r for r in read_metrics(tmp_path / "budget") if r["kind"] == "train"][-1]
    assert last["step"] == end  # the linear decay's last step runs at 1/decay_steps of the peak
    assert last["lr"] == pytest.approx(1e-2 / round(0.5 * end), rel=1e-4)
    assert (
        train(dataclasses.replace(budget, max_time=50.0))["step"] == end
    )  # finished: a larger budget says so
    assert (
        f"the run is finished: step {end} is where its --max-time budget ended it" in capsys.readouterr().out
    )

    plain = _budget_cfg(small_corpus, tmp_path / "plain", steps=end, dtype=dtype, average_weights=0.9)
    train(plain)
    rows = read_metrics(tmp_path / "plain")
    assert [r["step"] for r in rows if r["kind"] == "val"] == [end]
    first = end - round(0.9 * end) + 1
    averages = [r["average"] for run in (tmp_path / "budget", tmp_path / "plain") for r in read_metrics(run)
                if r["kind"] == "val" and r["step"] == end]  # fmt: skip
    assert averages[0]["steps"] == f"{first}-{end}" and first < stopped
    assert averages[0] == averages[1]
    assert Checkpointer(tmp_path / "plain").steps() == [end]
    a, b = load_model(tmp_path / "budget")[1], load_model(tmp_path / "plain")[1]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_budget_on_a_small_corpus_ends_after_max_epochs_passes_fully_decayed(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An hour's budget on ~200 short documents would read them hundreds of times; the run ends after
    --max-epochs passes instead, its schedule decayed to that end, saying so; run again, it says it is
    finished and how to train longer."""
    from minigpt.data.mixture import prepare_corpus
    from minigpt.training.metrics import read_metrics

    cfg = _budget_cfg(
        small_corpus, tmp_path / "run", max_time=3600.0, max_epochs=3.0, eval_every=0, weight_decay_passes=2.0
    )
    monkeypatch.setattr("minigpt.app.train.Clock", _TickingClock)
    train_tokens = prepare_corpus(cfg.data).first.size("train")
    epoch = train_tokens // cfg.tokens_per_step
    assert 10 < epoch < 200  # the corpus holds a hundred steps or so, the budget thousands
    assert train(cfg)["step"] == 3 * epoch
    out = capsys.readouterr().out
    said = f"one pass over the training text is {epoch:,} steps: the run ends by step {3 * epoch:,} (3 passes"
    assert said in out
    decay = 1 / (1e-2 * 2 * epoch)  # --weight-decay-passes 2: above AdamW's 0.1 for a pass this short
    assert f"weight decay {decay:.3g}: what the weights learn fades within 2 passes over" in out
    assert load_json(str(tmp_path / "run" / "config.json")).optimizer.weight_decay == pytest.approx(decay)
    last = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"][-1]
    assert last["step"] == 3 * epoch
    assert last["lr"] == pytest.approx(1e-2 / round(0.5 * 3 * epoch), rel=1e-4)
    assert train(dataclasses.replace(cfg, max_time=7200.0))["step"] == 3 * epoch
    said = f"the run is finished: step {3 * epoch} ends its 3 passes over the training text (--max-epochs)"
    assert said in capsys.readouterr().out


def _memorizable(tmp_path: Path) -> Path:
    """Documents of random words: nothing to learn beyond their frequencies, so a model that reads the
    training documents again and again memorises them and gets worse on the held-out ones."""
    from conftest import write_corpus

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(60)]
    return write_corpus(tmp_path / "random.txt", [" ".join(rng.choice(words, 24)) for _ in range(40)])


def _memorizable_cfg(tmp_path: Path, peak_lr: float, d_model: int, n_layers: int, **kw):
    """A float32 run on `_memorizable` text at a constant rate, validated on its held-out fifth."""
    from conftest import data_cfg

    from minigpt.config import ModelConfig
    from minigpt.optim.optimizer import ConstantSchedule

    corpus = _memorizable(tmp_path)
    return _budget_cfg(
        corpus, tmp_path / "run", batch_size=8, eval_batches=0,
        data=data_cfg(corpus, tmp_path / "cache", seq_len=16, val_fraction=0.2),
        schedule=ConstantSchedule(warmup_steps=0, peak_lr=peak_lr),
        model=ModelConfig(max_seq_len=16, d_model=d_model, n_layers=n_layers, n_heads=2, d_ff=4 * d_model,
                          dtype="float32"), **kw,
    )  # fmt: skip


def test_a_run_that_overfits_ends_with_the_best_weights_it_evaluated(tmp_path: Path) -> None:
    """Reading a small corpus many times makes the last evaluation worse than an earlier one: the run ends,
    reports and saves the best evaluated weights instead, so eval (and export) of the run get those."""
    from minigpt.inference.evaluate import validation
    from minigpt.training.metrics import read_metrics

    done = train(_memorizable_cfg(tmp_path, 1e-2, d_model=96, n_layers=2, steps=600, eval_every=75))
    val = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "val"]
    best = min(val[:-1], key=lambda r: r["loss"])
    assert val[-1]["last"]["loss"] > best["loss"] + 0.05  # the run did overfit
    assert val[-1]["weights_of_step"] == best["step"]
    assert done["bpb"] == val[-1]["bpb"] == best["bpb"]
    step, again = validation(str(tmp_path / "run"))
    assert step == 600 and again["bpb"] == pytest.approx(best["bpb"], rel=1e-6)


def test_a_run_that_averages_its_weights_ends_with_the_average_where_it_evaluates_better(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--average-weights 0.5 at a constant, high learning rate: the run evaluates the average of the last
    half's weights beside the last weights, says which is better, ends with that one, reports it with the
    other's figures beside it, and saves it, so eval of the run gets it. (Which one wins depends on the
    machine's float32 summation order: both outcomes are held to the same rules.)"""
    from minigpt.inference.evaluate import validation
    from minigpt.training.metrics import read_metrics

    done = train(_memorizable_cfg(tmp_path, 2e-2, d_model=64, n_layers=1, steps=120, average_weights=0.5))
    val = read_metrics(tmp_path / "run")[-1]
    assert val["kind"] == "val" and val["average"]["steps"] == "61-120"
    averaged = val.get("weights") == "average"
    last = val["last"]["bpb"] if averaged else val["bpb"]
    assert val["bpb"] == done["bpb"] == min(val["average"]["bpb"], last)
    assert averaged == (val["average"]["bpb"] < last)
    said = (
        f"step 120 | the average of steps 61-120's weights: val bits/byte {val['average']['bpb']:.4f} against"
    )
    ends = "the run ends with " + ("the average" if averaged else "the last weights")
    out = capsys.readouterr().out
    assert said in out and ends in out
    step, again = validation(str(tmp_path / "run"))
    assert step == 120 and again["bpb"] == pytest.approx(val["bpb"], rel=1e-6)


def _drifting_run(
    step_s: Callable[[int], float], max_time: float = 600.0
) -> tuple[Progress, float, list[int]]:
    """The cpu preset's schedule under a `max_time` budget (15 s of it compiling) whose step N takes
    step_s(N) seconds: the run's progress at its end, the training time it ended at, and its length after
    each step."""
    from minigpt.optim.optimizer import WSDSchedule

    clock = _SteppedClock()
    hook = BudgetHook(
        clock, max_time, 100_000, WSDSchedule(warmup_steps=10, peak_lr=0.02, decay_fraction=0.5)
    )
    p, ends = Progress(step=0, state=None, end=100_000), []
    clock.now = 15.0
    while p.step < p.end:
        p.step += 1
        clock.now += step_s(p.step)
        p.final = p.step == p.end
        if hook.due(p):
            hook(p)
        ends.append(p.end)
    return p, clock.now, ends


@pytest.mark.parametrize("before, after", [(0.3, 0.2), (0.2, 0.3)])
def test_a_budget_ends_on_time_when_the_machine_speeds_up_or_slows_down_during_the_decay(
    before: float, after: float
) -> None:
    """The pace changes by half just after the decay has begun (other work on a shared machine stops or
    starts): the length, fixed at the decay's start, once ended a 600 s budget at 527.9 s. It now moves
    with the pace, and the run ends within a few percent of its budget."""
    p, end_s, _ = _drifting_run(lambda step: before if step <= 1100 else after)
    assert p.budgeted and p.step == p.end
    assert abs(end_s - 600.0) < 0.03 * 600.0, (p.end, end_s)


def test_on_a_steady_machine_the_length_does_not_move_once_the_decay_has_begun() -> None:
    """Jitter of a few tenths of a percent never moves a length the schedule depends on: the run is then
    exactly a run of that length."""
    p, end_s, ends = _drifting_run(lambda step: 0.25 * (1 + 0.004 * (step % 3 - 1)))
    decay_start = p.end - round(0.5 * p.end)
    assert set(ends[decay_start:]) == {p.end}
    assert abs(end_s - 600.0) < 0.01 * 600.0, (p.end, end_s)


def test_the_log_says_steps_are_being_timed_then_counts_the_budget_down(tmp_path: Path) -> None:
    """No step total and hours-long ETA before the pace is known; then the budget's time left, which does
    not jump with the laid-out length."""
    from minigpt.optim.optimizer import WSDSchedule
    from minigpt.training.metrics import MetricsWriter

    cfg = dataclasses.replace(PRESETS["cpu"], steps=100_000, batch_size=2, log_every=10, max_time=600.0)
    clock, metrics = _SteppedClock(), StepMetrics(_NoCheckpoints())
    budget = BudgetHook(
        clock, 600.0, cfg.steps, WSDSchedule(warmup_steps=10, peak_lr=0.02, decay_fraction=0.5)
    )
    log = LogHook(10, cfg, metrics, clock, MetricsWriter(tmp_path), peak=None, last_step=0)
    p, lines = Progress(step=0, state=None, end=cfg.steps), []
    clock.now = 15.0
    for step in range(1, 31):
        p.step, clock.now = step, clock.now + 0.25
        metrics.add(step, {"loss": np.float32(1.0), "grad_norm": np.float32(1.0), "lr": np.float32(0.1)})
        if budget.due(p):
            budget(p)
        if log.due(p):
            lines.append(log.eta(p, 0.25))
            log(p)
    assert lines[0] == "timing steps for the 0:10:00 budget ..."
    assert lines[1:] == ["ETA 0:09:40 of the 0:10:00 budget", "ETA 0:09:37 of the 0:10:00 budget"]


def test_training_other_data_into_a_used_run_dir_says_it_holds_another_run(
    small_corpus: Path, tmp_path: Path
) -> None:
    """A second corpus trained into the same run directory (the default runs/cpu) is refused for what it is,
    another run, naming the ways out; not for the tokenizer its BPE trained on the other text."""
    from conftest import DOCS, raises_config_error

    train(_budget_cfg(small_corpus, tmp_path / "run", steps=2, log_every=1))
    other = tmp_path / "other.txt"
    other.write_text("\n<|endoftext|>\n".join(DOCS))
    with raises_config_error(f"{tmp_path / 'run'} holds another run on other data") as refused:
        train(_budget_cfg(other, tmp_path / "run", steps=2, log_every=1))
    assert "--run-dir" in str(refused.value) and "--overwrite" in str(refused.value)


def test_a_sample_prints_as_the_text_it_is() -> None:
    """Not a Python-escaped one-liner: each line of the sample on a line of its own, indented."""
    from minigpt.app.hooks import format_sample

    out = format_sample(100, 'Once upon a time, Tom said "hi".\n\nThe end.\n')
    assert out == 'step    100 | sample:\n    | Once upon a time, Tom said "hi".\n    |\n    | The end.'


def test_startup_says_what_it_does_in_order_then_how_long_it_took(small_corpus: Path, tmp_path: Path) -> None:
    """From the command to the first step, each stage says what it does (tokenizer, tokens, compiling the
    train and eval steps, before the clock starts), and the first step says how long startup took; a budget
    that --steps ends first leaves the log's step total and ETA as without one."""
    import subprocess
    import sys

    from conftest import TINY_FLAGS, WORKDIR, cli_env

    out = subprocess.run(
        [sys.executable, "-m", "minigpt.cli", "train", "--data", str(small_corpus), *TINY_FLAGS,
         "--data.cache-dir", str(tmp_path / "cache"), "--run-dir", str(tmp_path / "run"), "--steps", "4",
         "--max-time", "3600", "--log-every", "1", "--eval-every", "2", "--sample-tokens", "4"],
        env=cli_env(), cwd=WORKDIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
        input="",
    )  # fmt: skip
    lines = out.stdout.splitlines()
    expected = [
        "training a 300-token byte-level BPE",
        "BPE: read ",
        "BPE: 300 tokens learned from ",
        "compiling the train and eval steps ...",
        "compiled the train and eval steps in ",
        "took step 1 in ",
        "step      1/4 | loss",
        "step      2 | val loss",
    ]
    found = [next((i for i, line in enumerate(lines) if line.startswith(e)), None) for e in expected]
    assert None not in found and found == sorted(found), (found, out.stdout)
    startup = re.search(r"startup took (\d+) s \(from the command to the first step: (.*)\)", lines[found[5]])
    assert startup, lines[found[5]]  # itemised: where a slow start went
    items = [re.fullmatch(r"(.+) (\d+) s", item).groups() for item in startup.group(2).split(", ")]
    names = [name for name, _ in items]
    assert "compiling" in names and names[-1] == "the rest", items
    shown = sum(int(s) for _, s in items)  # each rounded, stages under half a second left out
    assert abs(shown - int(startup.group(1))) <= len(items) + 3, (shown, startup.group(0))
    assert lines[found[6]].startswith("step      1/4 |") and "ETA" in lines[found[6]]  # --steps ends it first


@pytest.mark.parametrize("switch", range(940, 1000, 6))
def test_the_decay_line_names_the_end_the_run_keeps(switch: int, capsys: pytest.CaptureFixture) -> None:
    """The line saying the decay has begun names the run's end after that timing: a pace change found at the
    same timing moves the end first (it once said "ends at step 50", then at once "now ends at step 44")."""
    capsys.readouterr()
    _, _, ends = _drifting_run(lambda step: 0.3 if step <= switch else 0.2)
    lines = capsys.readouterr().out.splitlines()
    begun = [line for line in lines if "the schedule's decay has begun" in line]
    assert len(begun) == 1, lines
    step = int(begun[0].split()[1].rstrip(":"))
    assert f"the run ends at step {ends[step - 1]} " in begun[0]
    assert not any(line.startswith(f"step {step}: the pace moved") for line in lines)


def test_the_time_budget_does_not_count_compiling(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A train step whose compiling takes longer than the whole --max-time budget (here made slow on purpose,
    as a large model's is on an accelerator) still trains for the budget: the steps are compiled before the
    clock starts. It once ended after one step ("max_time 2s reached"), a 1-step model."""
    from jax._src import compilation_cache, compiler

    compile_program = compiler.backend_compile_and_load

    def slow_train_step(backend, module, *args, **kwargs):
        if "train_step" in str(module.operation.attributes["sym_name"]):
            time.sleep(4.0)
        return compile_program(backend, module, *args, **kwargs)

    monkeypatch.setattr(compiler, "backend_compile_and_load", slow_train_step)
    monkeypatch.setattr(compilation_cache, "is_persistent_cache_enabled", lambda: False)  # compiled here
    cfg = _budget_cfg(small_corpus, tmp_path / "run", max_time=2.0, sample_tokens=0, log_every=1)
    result = train(cfg)
    out = capsys.readouterr().out
    compiled = next(
        line for line in out.splitlines() if line.startswith("compiled the train and eval steps in")
    )
    assert float(compiled.split(" in ")[1].split()[0]) >= 4.0
    assert result["step"] > 1, out  # trained after compiling: not stopped at step 1
    records = [r for r in read_metrics(tmp_path / "run") if r.get("kind") == "train"]
    assert records and records[-1]["elapsed_s"] < 4.0  # the training time the budget counts leaves it out


def test_a_budget_that_holds_only_a_few_steps_says_so(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A --max-time budget too short for the model ends with a one-line warning saying how few steps it held
    and how to get more, where it once exited 0 after one step without a word."""
    cfg = _budget_cfg(small_corpus, tmp_path / "run", max_time=1e-3, sample_tokens=0)
    assert train(cfg)["step"] < 20
    warning = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: the 0.001 s")
    ]
    assert len(warning) == 1 and "raise --max-time" in warning[0], warning
