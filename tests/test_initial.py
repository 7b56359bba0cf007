"""--init-from: a run starts from a transformers checkpoint's or a minigpt run's weights, with the source's
model and tokenizer, the finetune preset by default, and resumes like any run."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY_FLAGS, cli_error, run_cli

from minigpt.app.initial import ignored_flags, initial_state, with_initial
from minigpt.commands.flags import parse_train
from minigpt.config import get_preset
from minigpt.hf.export import gather_params
from minigpt.hf.import_ import minigpt_arrays
from minigpt.hf.weights import read_weights
from minigpt.optim.optimizer import AdamW, CosineDecaySchedule
from minigpt.training.trainer import build


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, hf) -> Path:
    from fixtures.checkpoints import chat_checkpoint

    folder = tmp_path_factory.mktemp("llama")
    chat_checkpoint(folder, hf, head_dim=32, rope_theta=50000.0)
    return folder


def test_the_source_decides_the_model_and_tokenizer_and_the_preset_is_finetune(checkpoint: Path) -> None:
    """What the weights compute comes from the checkpoint; how the run computes it (dtype, remat) from its
    flags; with --init-from and no --preset the defaults are the finetune preset's."""
    asked = parse_train(["--init-from", str(checkpoint), "--model.remat", "full", "--model.d-model", "512"],
                         "minigpt train")  # fmt: skip
    cfg = with_initial(asked)
    model, data = cfg.model, cfg.data
    assert ignored_flags(asked.model, model) == ["model.d_model=512"]  # what train says it ignores
    assert (model.d_model, model.n_layers, model.head_dim, model.norm_eps) == (64, 2, 32, 1e-6)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    assert model.remat == "full" and model.dtype == "auto" and model.vocab_size == vocab
    assert data.tokenizer == "hf" and data.hf_tokenizer == str(checkpoint.absolute())
    assert isinstance(cfg.optimizer, AdamW) and cfg.schedule == get_preset("finetune").schedule
    assert isinstance(cfg.schedule, CosineDecaySchedule) and cfg.schedule.decay_lr == 0.0


def test_a_window_longer_than_the_checkpoints_context_is_cut_to_it(checkpoint: Path) -> None:
    """The finetune preset's model is a placeholder until the source is read: its context does not refuse a
    --data.seq-len the checkpoint allows, and one the checkpoint does not is cut to its context."""
    cfg = with_initial(
        parse_train(["--init-from", str(checkpoint), "--data.seq-len", "100000"], "minigpt train")
    )
    assert cfg.data.seq_len == cfg.model.max_seq_len == 128


def test_without_a_seq_len_the_window_is_the_checkpoints_context_as_far_as_memory_allows(
    checkpoint: Path, tmp_path: Path, hf, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finetune preset does not cut a checkpoint's examples shorter than its context: windows are its
    whole context, or, where a step of them would not fit in memory, the longest halving that does."""
    from fixtures.checkpoints import chat_checkpoint
    from minigpt.training import memory

    cfg = with_initial(parse_train(["--init-from", str(checkpoint)], "minigpt train"))
    assert cfg.data.seq_len == cfg.model.max_seq_len == 128
    assert f"windows of 128 tokens, the context of --init-from {checkpoint}" in capsys.readouterr().out
    chat_checkpoint(tmp_path / "long", hf, max_position_embeddings=1024)
    assert (
        with_initial(parse_train(["--init-from", str(tmp_path / "long")], "minigpt train")).data.seq_len
        == 1024
    )
    # A machine whose memory holds this batch of 256-token windows but not of longer ones:
    fits = memory.make_plan(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=256))).total
    monkeypatch.setattr(memory, "capacity", lambda kind, n: (fits / (1 - memory.HEADROOM) + 1, "test"))
    monkeypatch.setattr(memory, "quick_bound", lambda *a: 1 << 62)
    small = with_initial(parse_train(["--init-from", str(tmp_path / "long")], "minigpt train"))
    assert small.data.seq_len == 256
    assert "windows of 256 tokens of the 1024-token context" in capsys.readouterr().out
    given = parse_train(["--init-from", str(tmp_path / "long"), "--data.seq-len", "512"], "minigpt train")
    assert with_initial(given).data.seq_len == 512  # asked for: as asked (capped at the context only)


def test_step_zero_holds_the_checkpoints_weights(checkpoint: Path) -> None:
    cfg = with_initial(parse_train(["--init-from", str(checkpoint), "--model.scan-layers"], "minigpt train"))
    setup = build(cfg)
    state = initial_state(setup)
    expected = minigpt_arrays(cfg.model, "LlamaForCausalLM", read_weights(checkpoint))
    got = gather_params(state.params, cfg.model)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert np.array_equal(got[name], value.astype(np.float32)), name
    assert int(state.step) == 0 and all(not np.any(m) for m in jax.tree.leaves(state.opt_state[1][0].mu))


def test_a_run_trained_further_from_a_run_keeps_what_it_learned(tiny_run, tmp_path: Path) -> None:
    """The complaint that started this: an imported model trained further at the cpu preset's rates got
    worse at once. From a run, the finetune preset's first steps on the same text do not lose ground, and the
    same command again resumes the new run rather than starting over."""
    corpus, cache, run = tiny_run
    data = [
        "--data",
        str(corpus),
        "--data.cache-dir",
        str(cache),
        "--data.seq-len",
        "16",
        "--batch-size",
        "4",
    ]
    before = _val_bpb(run_cli("eval", "--run", str(run)).stdout)
    argv = ["train", "--init-from", str(run), *data, "--run-dir", str(tmp_path / "more"), "--eval-every", "10",
            "--eval-batches", "0", "--sample-tokens", "0", "--max-time", "0"]  # fmt: skip
    out = run_cli(*argv, "--steps", "10")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"starting from the weights of {run}" in out.stdout
    assert "sample:" not in out.stdout  # --sample-tokens 0
    assert not (tmp_path / "more" / "samples.txt").exists()
    after = _val_bpb(run_cli("eval", "--run", str(tmp_path / "more")).stdout)
    print(f"\n--init-from a run, 10 finetune steps on its text: {before:.4f} -> {after:.4f} bits per byte")
    assert after <= before + 1e-3, (before, after)
    saved = json.loads((tmp_path / "more" / "config.json").read_text())
    assert saved["model"]["d_model"] == 32 and saved["init_from"] == str(run)
    again = run_cli(*argv, "--steps", "12")
    assert again.returncode == 0 and "resumed from step 10" in again.stdout, again.stderr[-3000:]


def _val_bpb(out: str) -> float:
    return float(re.search(r"val bits/byte ([0-9.]+)", out)[1])


def test_a_source_that_is_not_a_checkpoint_is_one_line(tmp_path: Path, capsys) -> None:
    err = cli_error(capsys, ["train", "--init-from", str(tmp_path / "nothing"), *TINY_FLAGS])
    assert "--init-from" in err and "not a folder" in err
    (tmp_path / "x.npz").write_bytes(b"")
    assert "not a folder" in cli_error(capsys, ["train", "--init-from", str(tmp_path / "x.npz")])
