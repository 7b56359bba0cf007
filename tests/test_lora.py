"""LoRA: adapters beside the projections (Flax NNX's nnx.LoRA), the base frozen, optimizer state for the
adapters only, merged or PEFT-format exports, and the same losses as PEFT with TRL on the same checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import cli_error
from sft_runs import STEPS, minigpt_config, minigpt_losses, trl_losses

from minigpt.app.initial import initial_state
from minigpt.config import ConfigError, LoRAConfig, ModelConfig
from minigpt.hf.export import gather_params
from minigpt.nn import lora
from minigpt.training.trainer import build, make_train_step, random_batch, trained

FLAGS = ("--lora.rank", "8", "--lora.alpha", "16")


def test_adapters_start_at_zero_and_only_they_train(sft: Path) -> None:
    """Step 0 computes the checkpoint exactly (B = 0); a step changes the adapters and nothing else, and the
    optimizer keeps state for the adapters alone."""
    cfg = minigpt_config(sft, 2, *FLAGS, run="run-lora-steps")
    setup = build(cfg)
    state = initial_state(setup)
    adapters, base = trained(state.params)
    assert base is not None and all(
        not np.any(b) for n, b in gather_params(adapters, cfg.model).items() if n.endswith("_b")
    )
    mu = jax.tree.leaves(state.opt_state[1][0].mu)
    assert sum(x.size for x in mu) == lora.size(state.params)[0] < lora.size(state.params)[1] / 5
    before = gather_params(state.params, cfg.model)
    state, _ = make_train_step(setup)(state, random_batch(setup), cfg.steps)
    after = gather_params(state.params, cfg.model)
    changed = {n for n in before if not np.array_equal(before[n], after[n])}
    assert changed and all(lora.is_adapter(n) for n in changed)
    assert {n for n in before if n.endswith("lora_b")} <= changed


def test_checkpoints_hold_the_adapters_and_the_run_resumes_and_generates(sft: Path) -> None:
    """The base is written once (base/); each checkpoint holds the adapters and their optimizer state only.
    The run resumes from them and generate, eval, check and export read it whole."""
    from minigpt.app.check import check_run
    from minigpt.cli import main
    from minigpt.training.checkpoint import Checkpointer

    cfg = minigpt_config(sft, 2, *FLAGS, run="run-lora-resume")
    minigpt_losses(cfg)
    ckpt = Checkpointer(cfg.run_dir)
    names = [n for n in ckpt._saved_shapes(2) if n.startswith("params.")]
    assert names and all(lora.is_adapter(n.removeprefix("params.").replace(".value", "")) for n in names), (
        names
    )
    ckpt.close()
    assert (Path(cfg.run_dir) / "base").is_dir()
    losses = minigpt_losses(dataclasses.replace(cfg, steps=4, overwrite=False))
    assert len(losses) == 4  # two before, two resumed
    assert not check_run(cfg.run_dir).problems
    main(
        [
            "generate",
            "--run",
            cfg.run_dir,
            "--prompt",
            "What did",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
        ]
    )


def test_what_has_no_adapters_or_lost_its_base_is_one_line(
    capsys, tiny_run, sft: Path, tmp_path: Path
) -> None:
    """export --adapters of a run without LoRA, and a LoRA run whose base/ is gone: each refused in one line
    saying what to do."""
    import shutil

    from minigpt.training.runs import load_model

    run = str(tiny_run[2])
    out = str(tmp_path / "adapters")
    assert "has no adapters (it trained without --lora.rank)" in cli_error(
        capsys, ["export", "--run", run, "--adapters", "--out", out]
    )
    cfg = minigpt_config(sft, 1, *FLAGS, run="run-lora-lost-base")
    minigpt_losses(cfg)
    shutil.rmtree(Path(cfg.run_dir) / "base")
    with pytest.raises(ConfigError, match="base is missing: a LoRA run's checkpoints hold its adapters"):
        load_model(cfg.run_dir)


def test_merging_folds_each_adapter_into_its_projection() -> None:
    rng = np.random.default_rng(0)
    cfg = LoRAConfig(rank=2, alpha=6.0)
    named = {
        "blocks.0.attn.q.kernel": rng.normal(size=(4, 3)).astype(np.float32),
        "blocks.0.attn.q.adapter.lora.lora_a": rng.normal(size=(4, 2)).astype(np.float32),
        "blocks.0.attn.q.adapter.lora.lora_b": rng.normal(size=(2, 3)).astype(np.float32),
        "ln_f.scale": np.ones(4, np.float32),
    }
    out = lora.merged(named, cfg)
    assert set(out) == {"blocks.0.attn.q.kernel", "ln_f.scale"}
    x = rng.normal(size=(5, 4))
    adapted = (
        x @ named["blocks.0.attn.q.kernel"]
        + 3.0
        * x
        @ named["blocks.0.attn.q.adapter.lora.lora_a"]
        @ named["blocks.0.attn.q.adapter.lora.lora_b"]
    )
    np.testing.assert_allclose(x @ out["blocks.0.attn.q.kernel"], adapted, rtol=1e-5)


def test_bad_lora_settings_are_one_line(capsys, tmp_path: Path) -> None:
    assert "lora.targets: 'qkv' is none of q k v o gate up down" in cli_error(
        capsys, ["train", "--lora.rank", "4", "--lora.targets", "qkv"]
    )
    assert "lora.rank must be >= 0" in cli_error(capsys, ["train", "--lora.rank", "-1"])
    corpus = tmp_path / "c.txt"
    corpus.write_text("a story\n" * 100)
    assert "--lora.rank trains adapters on a trained model: name it with --init-from" in cli_error(
        capsys, ["train", "--lora.rank", "4", "--data", str(corpus), "--run-dir", str(tmp_path / "r")]
    )
    with pytest.raises(ConfigError, match="this model's MLP has no gate projection"):
        dataclasses.replace(ModelConfig(activation="gelu"), lora=LoRAConfig(rank=4, targets=("q", "gate")))


@pytest.mark.slow
def test_lora_losses_equal_peft_with_trl_and_the_exports_load(sft: Path, hf) -> None:
    """The peer's numbers: PEFT LoRA of the same rank, alpha and targets, starting from minigpt's step-0
    adapters (written by `export --adapters`' own code), trained by TRL on the same conversations."""
    from peft import PeftModel

    from minigpt.hf.adapters import peft_config, peft_tensors, write_peft

    torch, transformers = hf
    cfg = minigpt_config(sft, STEPS, *FLAGS, run="run-lora")
    state = initial_state(build(cfg))
    tensors, placement = peft_tensors(cfg.model, gather_params(state.params, cfg.model))
    write_peft(sft / "lora-step0", tensors, peft_config(cfg.model.lora, placement, str(sft / "checkpoint")))
    targets = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert placement == {"target_modules": targets, "fan_in_fan_out": False}
    base = transformers.AutoModelForCausalLM.from_pretrained(sft / "checkpoint", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, sft / "lora-step0", is_trainable=True)
    ours, theirs = minigpt_losses(cfg), trl_losses(sft, hf, STEPS, model=peft_model)
    print("minigpt", ours[:3], ours[-3:], "\nPEFT", theirs[:3], theirs[-3:])
    assert len(ours) == len(theirs) == STEPS
    assert abs(ours[0] - theirs[0]) < 1e-4
    assert np.max(np.abs(np.array(ours) / np.array(theirs) - 1)) < 1e-3  # the target is 1%
    _exports_load(sft, hf, Path(cfg.run_dir))


def test_a_gpt2_checkpoint_fine_tunes_with_and_without_adapters_chats_and_exports(tmp_path: Path, hf) -> None:
    """GPT-2 (q, k and v in one Conv1D, c_attn): full fine-tuning and LoRA on some of its projections train on
    conversations; the LoRA run chats; both exports write transformers' greedy text, and the adapters load in
    PEFT as one adapter on c_attn (rank 2r for q and v, alpha 2 alpha) computing the merged export's logits."""
    from fixtures.checkpoints import GENERATION_CHATML, chat_checkpoint, conversations
    from minigpt.hf import export_hf
    from minigpt.inference.conversation import Conversation
    from minigpt.inference.generate import SamplingConfig
    from minigpt.training.runs import load_model

    torch, transformers = hf
    chat_checkpoint(
        tmp_path / "checkpoint", hf, "GPT2LMHeadModel", GENERATION_CHATML, tie_word_embeddings=True
    )
    for name, examples in (("train", conversations(16)), ("val", conversations(4, 1, ("Sam", "Zoe")))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    full = minigpt_config(tmp_path, 5, run="full")
    minigpt_losses(dataclasses.replace(full, schedule=dataclasses.replace(full.schedule, peak_lr=1e-2)))
    export_hf(full.run_dir, tmp_path / "full-hf")
    _greedy_text_agrees(
        Path(full.run_dir), transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full-hf"), torch
    )
    tuned = minigpt_config(tmp_path, 5, *FLAGS, "--lora.targets", "q", "v", "down", run="lora")
    minigpt_losses(tuned)
    config = _peft_computes_the_merged_export(Path(tuned.run_dir), tmp_path, hf)
    assert config["target_modules"] == ["attn.c_attn", "mlp.c_proj"] and config["fan_in_fan_out"]
    assert (config["rank_pattern"], config["alpha_pattern"]) == ({"c_attn": 16}, {"c_attn": 32})
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    _greedy_text_agrees(Path(tuned.run_dir), merged, torch)
    setup, params, tok, _ = load_model(tuned.run_dir)
    chat = Conversation(setup, params, tok, SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert chat.say("What did Tom like?") and chat.say("And then?") and len(chat.messages) == 4


def _exports_load(sft: Path, hf: tuple, run: Path) -> None:
    """The adapters as a PEFT folder load onto the base and compute the merged export's logits, whose greedy
    text is minigpt's."""
    torch, transformers = hf
    config = _peft_computes_the_merged_export(run, sft, hf)
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(sft / "checkpoint")
    merged = transformers.AutoModelForCausalLM.from_pretrained(sft / "merged", dtype=torch.float32)
    _greedy_text_agrees(run, merged, torch)


def _peft_computes_the_merged_export(run: Path, folder: Path, hf: tuple) -> dict:
    """Export `run` as a PEFT folder (folder/adapters) and merged (folder/merged): PEFT's adapters on the
    base checkpoint (folder/checkpoint) compute the merged export's logits. Returns adapter_config.json."""
    from peft import PeftModel

    from minigpt.hf import export_hf
    from minigpt.hf.adapters import export_adapters

    torch, transformers = hf
    export_adapters(run, folder / "adapters")
    export_hf(run, folder / "merged")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder / "checkpoint", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, folder / "adapters")
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder / "merged", dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 30, 41, 7]])
    with torch.no_grad():
        np.testing.assert_allclose(adapted(ids).logits.numpy(), merged(ids).logits.numpy(), atol=1e-4)
    return json.loads((folder / "adapters" / "adapter_config.json").read_text())


def _greedy_text_agrees(run: Path, merged, torch) -> None:
    """`minigpt generate --temperature 0` on the LoRA run writes what transformers writes with the merged
    export, up to the end of the turn."""
    from minigpt.inference.generate import SamplingConfig, generate_ids
    from minigpt.training.runs import load_model

    setup, params, tok, _ = load_model(run)
    prompt = tok.encode_chat("<|im_start|>user\nWhat did Tom like?<|im_end|>\n<|im_start|>assistant\n")
    mine = generate_ids(setup.graphdef, params, prompt, SamplingConfig(max_new_tokens=12, temperature=0.0),
                        eot_id=tok.eot_id, max_seq_len=setup.cfg.model.max_seq_len, stop_ids=tok.stop_ids)[0]  # fmt: skip
    with torch.no_grad():
        out = merged.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=12)[0, len(prompt):].tolist()  # fmt: skip
    stops = [i for i, t in enumerate(out) if t in tok.stop_ids]
    assert mine == out[: stops[0] if stops else None] and len(mine) >= 3, (tok.decode(mine), tok.decode(out))


def test_adapter_dropout_acts_in_training_only() -> None:
    """With a dropout key the adapters' input is dropped (and rescaled), changing their output; without one
    (evaluation, generation) the layer is deterministic. The base projection never sees the dropout."""
    import jax.numpy as jnp
    from flax import nnx

    from minigpt.nn.model import Linear

    layer = Linear(16, 8, ("embed", "mlp"), False, 0.02, nnx.Rngs(0), LoRAConfig(rank=4, dropout=0.5))
    layer.adapter.lora.lora_b[...] = jax.random.normal(jax.random.key(1), (4, 8))
    x = jax.random.normal(jax.random.key(2), (3, 16))
    plain = x @ layer.kernel[...]
    assert np.array_equal(layer(x), layer(x)) and not np.allclose(layer(x), plain)
    a, b = layer(x, jax.random.key(3)), layer(x, jax.random.key(4))
    assert not np.allclose(a, b) and not np.allclose(a, layer(x))
    keys = jax.random.split(jax.random.key(5), 10_000)
    mean = jnp.mean(jax.vmap(lambda k: layer(x, k))(keys), axis=0)
    scale = float(jnp.abs(layer(x)).max())
    np.testing.assert_allclose(mean, layer(x), atol=0.05 * scale)  # dropout keeps the expected output


@pytest.mark.slow
def test_a_qwen3_checkpoint_trains_adapters_that_peft_loads(tmp_path: Path, hf) -> None:
    """Another architecture (QK-norm, explicit head width): LoRA on conversations, then its PEFT folder on
    the base computes the merged export's logits."""
    from fixtures.checkpoints import GENERATION_CHATML, chat_checkpoint, conversations

    chat_checkpoint(tmp_path / "checkpoint", hf, "Qwen3ForCausalLM", template=GENERATION_CHATML, head_dim=32)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(16)))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(4, 1, ("Sam",))))
    cfg = minigpt_config(tmp_path, 3, "--lora.rank", "4", "--lora.targets", "q", "v", "down")
    assert len(minigpt_losses(cfg)) == 3
    config = _peft_computes_the_merged_export(Path(cfg.run_dir), tmp_path, hf)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
