"""Hugging Face transformers interop: models trained briefly on TinyStories, exported with `minigpt export
--format hf` (the cpu preset's block among them, as Apertus), compute the same logits (<= 1e-4) and greedy
continuations in transformers (torch, float32), their tokenizers encode the validation text as minigpt does,
import -> export round-trips bit-exactly, an import continues pretraining, and architectures with no
faithful transformers class are refused.

transformers and torch are test-only dependencies: the tests that need them are skipped without them."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import shlex
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import OPTIMISED, cli_error, run_cli, run_on_devices
from flax import nnx
from safetensors.numpy import load_file, save_file

from minigpt.cli import main
from minigpt.commands.flags import parse_train
from minigpt.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    TrainConfig,
    config_changes,
    get_preset,
    save_json,
    to_dict,
)
from minigpt.data.tokenizer import EOT, BPETokenizer
from minigpt.hf import (
    APERTUS,
    GPT2,
    LLAMA,
    QWEN2,
    QWEN3,
    export_hf,
    gather_params,
    hf_architecture,
    hf_config,
    hf_tensors,
    import_hf,
    minigpt_arrays,
    model_config_from_hf,
    train_command,
    write_hf,
)
from minigpt.hf.export import MINIGPT_CONFIG
from minigpt.hf.import_ import _same_function
from minigpt.inference.generate import SamplingConfig, generate_ids
from minigpt.nn.model import GPT
from minigpt.optim.optimizer import Lion, WSDSchedule
from minigpt.training.runs import load_model
from minigpt.training.trainer import build

TOL = 1e-4  # max |logit difference| in float32
STEPS = 100  # fewer (40) leaves greedy text one or two tokens repeated: nothing to compare
MODEL = ["--model.d-model", "64", "--model.n-heads", "4", "--model.n-layers", "2", "--model.d-ff", "128",
         "--model.max-seq-len", "128", "--model.dtype", "float32"]  # fmt: skip
"""float32: the exports are compared with transformers' float32 computation to float32's precision."""
LLAMA_SHAPE = ["--model.position", "rope", "--model.norm", "rmsnorm", "--model.activation", "swiglu",
               "--model.n-kv-heads", "2", "--model.no-bias", "--model.no-qk-norm", "--data.tokenizer", "bpe",
               "--data.bpe-vocab-size", "512"]  # fmt: skip
GPT2_SHAPE = ["--model.position", "learned", "--model.norm", "layernorm", "--model.activation", "gelu",
              "--model.bias", "--model.no-qk-norm"]  # fmt: skip
ARCHS = {
    # GPT-2's shape: learned positions, LayerNorm, GELU, biases, tied embeddings; GPT-2's BPE.
    "gpt2": (GPT2, [*GPT2_SHAPE, "--model.tie-embeddings", "--data.tokenizer", "gpt2"]),
    # Llama's: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases; a BPE trained on the corpus.
    "llama-tied": (LLAMA, [*LLAMA_SHAPE, "--model.tie-embeddings"]),
    "llama-untied": (LLAMA, [*LLAMA_SHAPE, "--model.no-tie-embeddings", "--model.scan-layers",
                             "--model.rope-theta", "50000"]),
    # The cpu preset's block as it is (RoPE, RMSNorm, ReLU², QK-norm, no biases, untied), smaller.
    "cpu-preset": (APERTUS, ["--data.bpe-vocab-size", "512"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def corpus(tinystories: Path, root: Path) -> tuple[Path, Path]:
    """~400 KB of real TinyStories training text (cut at a document boundary) and the validation split."""
    text = (tinystories / "train.txt").read_text()
    cut = text.index(EOT, 400_000) + len(EOT)
    (root / "train.txt").write_text(text[:cut] + "\n")
    return root / "train.txt", tinystories / "valid.txt"


def _minigpt(*args: str) -> str:
    """`minigpt ARGS` run in this process, and what it printed: what is under test is the command, not
    starting a program (an error exits, failing the test with its one line)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(list(args))
    return printed.getvalue()


_EXPORTS: dict[str, tuple[Path, Path]] = {}


def _exported(
    arch: str, root: Path, corpus: tuple[Path, Path], request: pytest.FixtureRequest
) -> tuple[Path, Path]:
    """(run directory, transformers folder) of a model of shape `arch` trained STEPS steps (AdamW at a constant
    3e-3, whatever the cpu preset's optimizer), then exported by the CLI; made once per test session. No text
    is sampled during training (--sample-tokens 0): nothing here reads it, and it would compile a decoder."""
    if arch not in _EXPORTS:
        extra = ARCHS[arch][1]
        if "gpt2" in extra:
            extra = [*extra, "--data.gpt2-dir", str(request.getfixturevalue("gpt2_dir"))]
        run, out = root / f"run-{arch}", root / f"hf-{arch}"
        trained = run_cli("train", "--data", str(corpus[0]), "--val-data", str(corpus[1]), "--data.cache-dir",
                          str(root / "cache"), "--run-dir", str(run), *MODEL, *extra, "--data.seq-len", "64",
                          "--batch-size", "8", "--steps", str(STEPS), "--eval-every", "1000", "--eval-batches",
                          "2", "--log-every", "10", "--sample-tokens", "0", "optimizer:adam-w",
                          "schedule:constant-schedule", "--schedule.warmup-steps", "0", "--schedule.peak-lr",
                          "3e-3", env=OPTIMISED if arch == "gpt2" else None)  # fmt: skip
        assert trained.returncode == 0, trained.stderr[-3000:]
        export = _minigpt("export", "--run", str(run), "--format", "hf", "--out", str(out))
        assert f"as a transformers {ARCHS[arch][0]}" in export
        _EXPORTS[arch] = run, out
    return _EXPORTS[arch]


@pytest.fixture(scope="module", params=list(ARCHS))
def exported(request: pytest.FixtureRequest, root: Path, corpus: tuple[Path, Path]) -> tuple[str, Path, Path]:
    return (request.param, *_exported(request.param, root, corpus, request))


def _documents(valid: Path, n: int | None = None) -> list[str]:
    docs = [d.strip("\n") for d in valid.read_text().split(EOT)]
    return [d for d in docs if d][:n]


def _logits(setup, params, tokens: np.ndarray) -> np.ndarray:
    """minigpt's float32 logits over the real vocabulary, compiled (op-by-op it is several times slower)."""
    forward = jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))
    return np.asarray(forward(params, jnp.asarray(tokens)))[..., : setup.cfg.model.vocab_size]


def _hf_logits(model, tokens: np.ndarray, torch) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def test_exported_model_computes_minigpts_logits_and_greedy_text(exported, corpus, hf) -> None:
    arch, run, out = exported
    torch, transformers = hf
    setup, params, tok, _ = load_model(run)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == ARCHS[arch][0]
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.eot_id

    # Real validation text, packed as minigpt trains on it (documents separated by end-of-text).
    ids: list[int] = []
    for doc in _documents(corpus[1], 40):
        ids += [*tok.encode(doc), tok.eot_id]
    S = setup.cfg.model.max_seq_len
    tokens = np.array(ids[: 3 * S], np.int32).reshape(3, S)
    ours, theirs = _logits(setup, params, tokens), _hf_logits(model, tokens, torch)
    diff = float(np.abs(ours - theirs).max())
    print(f"\n{arch}: max |logit difference| {diff:.3g} over {tokens.size} positions (logits up to {np.abs(ours).max():.1f})")  # fmt: skip
    assert diff <= TOL

    generated: set[int] = set()
    for doc in _documents(corpus[1])[100:103]:
        prompt = tok.encode(doc)[:16]
        mine = generate_ids(setup.graphdef, params, prompt, SamplingConfig(max_new_tokens=50, temperature=0.0),
                            eot_id=tok.eot_id, max_seq_len=S)[0]  # fmt: skip
        with torch.no_grad():
            out_ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     do_sample=False, max_new_tokens=50)[0, len(prompt):].tolist()  # fmt: skip
        # minigpt stops before end-of-text, transformers after it: compare up to the first one.
        theirs_text = out_ids[: out_ids.index(tok.eot_id)] if tok.eot_id in out_ids else out_ids
        assert mine == theirs_text, (tok.decode(mine), tok.decode(theirs_text))
        assert len(mine) == 50 or out_ids[len(mine)] == tok.eot_id
        generated |= set(mine)
    assert len(generated) >= 3  # not one token repeated everywhere (tiny models' greedy text does repeat)


def test_exported_tokenizer_encodes_the_validation_text_as_minigpt(exported, corpus, hf) -> None:
    arch, run, out = exported
    _, transformers = hf
    _, _, tok, _ = load_model(run)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token_id == tok.eot_id and theirs.eos_token == EOT
    docs = _documents(corpus[1])
    assert [theirs.encode(d) for d in docs] == [tok.encode(d) for d in docs]
    # The raw file spells "<|endoftext|>" between stories: text to minigpt's encoder, and so to the export's.
    raw = corpus[1].read_text()
    assert theirs.encode(raw) == tok.encode(raw)
    ids = tok.encode(docs[7])
    assert theirs.decode(ids) == tok.decode(ids) == docs[7]
    if arch == "gpt2":  # the same files as GPT-2's own tokenizer on the hub
        assert {p.name for p in out.iterdir()} >= {"vocab.json", "merges.txt", "tokenizer_config.json"}


def test_import_then_export_round_trips_bit_exactly(exported, root) -> None:
    arch, run, out = exported
    back, again = root / f"imported-{arch}", root / f"hf-again-{arch}"
    _, imported_arch, command = import_hf(out, back)
    assert imported_arch == ARCHS[arch][0] and command is not None
    export_hf(back, again)
    first, second = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == second[name].dtype == np.float32
        assert first[name].tobytes() == second[name].tobytes(), name
    assert (out / "config.json").read_text() == (again / "config.json").read_text()
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.json"):
        if (out / name).exists():
            assert (out / name).read_bytes() == (again / name).read_bytes(), name
    # And the imported minigpt parameters are the trained ones (padded vocabulary rows aside).
    (s1, p1, _, _), (s2, p2, _, step) = load_model(run), load_model(back)
    assert step == 0 and s2.cfg.model == s1.cfg.model and s2.cfg.data == s1.cfg.data
    a, b = gather_params(p1, s1.cfg.model), gather_params(p2, s2.cfg.model)
    V = s1.cfg.model.vocab_size
    assert a.keys() == b.keys()
    for name in a:
        x, y = (a[name][:V], b[name][:V]) if name == "wte" else (a[name], b[name])
        x, y = (x[:, :V], y[:, :V]) if name == "lm_head.kernel" else (x, y)
        assert np.array_equal(x, y), name


def test_imported_run_evaluates_like_the_original(root, corpus, request) -> None:
    run, out = _exported("llama-tied", root, corpus, request)
    back = root / "imported-eval"
    imp = _minigpt("import", "--hf", str(out), "--out", str(back))
    assert "imported a transformers LlamaForCausalLM" in imp and "continue training with:" in imp
    original, imported = _minigpt("eval", "--run", str(run), "--batches", "3"), _minigpt("eval", "--run", str(back), "--batches", "3")  # fmt: skip
    assert original.startswith(f"step {STEPS} |") and imported.startswith("step 0 |")
    assert original.split("|", 1)[1] == imported.split("|", 1)[1]  # same val loss and bits/byte


def test_a_foreign_gpt2_checkpoint_imports_and_continues_pretraining(root, corpus, request) -> None:
    run, out = _exported("gpt2", root, corpus, request)
    foreign = root / "foreign-gpt2"
    shutil.copytree(out, foreign)
    (foreign / "minigpt_config.json").unlink()  # as if made elsewhere: no minigpt run config, and named
    tensors = load_file(str(foreign / "model.safetensors"))  # as GPT-2 on the hub: no "transformer." prefix,
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}  # and the causal-mask buffers
    renamed |= {f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 128, 128), np.float32)) for i in range(2)}
    save_file(renamed, str(foreign / "model.safetensors"), metadata={"format": "pt"})
    back = root / "imported-foreign-gpt2"
    imp = _minigpt("import", "--hf", str(foreign), "--out", str(back), "--data", str(corpus[0]), "--val-data",
                   str(corpus[1]), "--data.cache-dir", str(root / "cache"))  # fmt: skip
    saved = json.loads((back / "config.json").read_text())
    assert saved["data"]["tokenizer"] == "gpt2" and saved["data"]["gpt2_dir"] == str(back / "tokenizer")
    gen = ["--prompt", "Once upon a time", "--max-new-tokens", "12", "--temperature", "0", "--no-stream"]
    assert _minigpt("generate", "--run", str(back), *gen) == _minigpt("generate", "--run", str(run), *gen)

    command = next(line for line in imp.splitlines() if line.startswith("continue training with: "))
    args = shlex.split(command.removeprefix("continue training with: "))
    assert args[:4] == ["minigpt", "train", "--preset", "finetune"]
    more = _minigpt(
        *args[1:], "--steps", "2", "--eval-batches", "1", "--sample-tokens", "2", "--log-every", "1"
    )
    assert "resumed from step 0" in more and "step      2/2" in more


MADE_BY_TRANSFORMERS = {
    LLAMA: dict(rope_theta=20000.0),
    # Apertus with ReLU² and plain RoPE, not its defaults (xIELU, llama3 RoPE scaling), which are refused.
    APERTUS: dict(hidden_act="relu2", rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
}


@pytest.mark.parametrize("arch", list(MADE_BY_TRANSFORMERS))
def test_a_checkpoint_saved_by_transformers_in_bfloat16_imports(arch: str, root, hf) -> None:
    """A Llama or Apertus made and saved by transformers itself (not by minigpt's exporter), in bfloat16."""
    torch, transformers = hf
    docs = ["Tom saw a big red ball. He was happy.", "Lily and Ben played in the park all day."] * 30
    tok = BPETokenizer.train(docs, 300)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        bos_token_id=tok.eot_id, eos_token_id=tok.eot_id, tie_word_embeddings=False,
        **MADE_BY_TRANSFORMERS[arch],
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.bfloat16)
    with torch.no_grad():  # norms (QK-norms included) are initialised to ones: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = root / f"from-transformers-{arch}"
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tok.tok.to_str())
    run, imported_arch, command = import_hf(folder, root / f"imported-bf16-{arch}")
    assert imported_arch == arch and "--data.tokenizer hf" in command  # it trains with its own tokenizer
    setup, params, _, _ = load_model(run)
    mc = setup.cfg.model
    assert mc.rope_theta == 20000.0 and mc.n_kv_heads == 2 and mc.qk_norm == (arch == APERTUS)
    assert mc.activation == ("relu2" if arch == APERTUS else "swiglu")
    tokens = np.array([tok.encode(" ".join(docs[:8]))[:60]], np.int32)
    # Reloaded in float32, not model.float(): .to(bfloat16) also rounded the RoPE frequencies (a buffer), which
    # with QK-norm's unit-scale queries and keys moves Apertus's logits by ~1e-4.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    diff = float(np.abs(_logits(setup, params, tokens) - _hf_logits(model, tokens, torch)).max())
    print(f"\ntransformers-made bfloat16 {arch}: max |logit difference| {diff:.3g}")
    assert diff <= TOL


# Random models of every exportable shape (no training needed): every parameter perturbed, so LayerNorm and
# RMSNorm scales, biases and the QK-norm all matter.
SHAPES = {
    "gpt2-relu2-untied-no-bias-scanned": (
        GPT2,
        dict(activation="relu2", tie_embeddings=False, bias=False, scan_layers=True),
    ),
    "gpt2-relu": (GPT2, dict(activation="relu", tie_embeddings=True)),
    "llama-biases-gqa": (
        LLAMA,
        dict(
            position="rope",
            norm="rmsnorm",
            activation="swiglu",
            n_kv_heads=2,
            tie_embeddings=True,
            rope_theta=500_000.0,
        ),
    ),
    "qwen3-qk-norm": (
        QWEN3,
        dict(
            position="rope",
            norm="rmsnorm",
            activation="swiglu",
            qk_norm=True,
            n_kv_heads=1,
            bias=False,
            scan_layers=True,
        ),
    ),
    "apertus-relu2-untied-gqa-scanned": (
        APERTUS,
        dict(
            position="rope",
            norm="rmsnorm",
            activation="relu2",
            qk_norm=True,
            n_kv_heads=2,
            bias=False,
            tie_embeddings=False,
            scan_layers=True,
            rope_theta=50_000.0,
        ),
    ),
    "qwen2-qkv-biases": (
        QWEN2,
        dict(
            position="rope",
            norm="rmsnorm",
            activation="swiglu",
            bias=False,
            qkv_bias=True,
            n_kv_heads=2,
            tie_embeddings=False,
            norm_eps=1e-6,
        ),
    ),
    # Llama 3.1's RoPE scaling (its original length under the context, so every band of it is used), heads
    # wider than d_model / n_heads, and another norm epsilon.
    "llama3-scaled-rope-wide-heads": (
        LLAMA,
        dict(
            position="rope",
            norm="rmsnorm",
            activation="swiglu",
            bias=False,
            head_dim=16,
            rope_theta=500_000.0,
            rope_scaling="llama3",
            rope_original_max_len=16,
            norm_eps=1e-6,
            tie_embeddings=False,
        ),
    ),
    "qwen3-wide-heads": (
        QWEN3,
        dict(position="rope", norm="rmsnorm", activation="swiglu", qk_norm=True, bias=False, head_dim=16),
    ),
    "apertus-gelu": (
        APERTUS,
        dict(
            position="rope", norm="rmsnorm", activation="gelu", qk_norm=True, bias=False, tie_embeddings=True
        ),
    ),
}


@functools.cache
def _random_model(**kw):
    """(setup, parameters) of a freshly initialised model with every parameter perturbed, made once per shape
    (the mapping, transformers and error tests share it): the initialisation compiled on its own (init_state
    would compile an optimizer state nothing here uses), the noise drawn by numpy (jax.random, eager, compiles
    a program per parameter shape)."""
    mc = ModelConfig(vocab_size=300, max_seq_len=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, **kw)
    setup = build(TrainConfig(model=mc, data=DataConfig(seq_len=32), batch_size=2))
    params = jax.jit(lambda: nnx.split(GPT(mc, nnx.Rngs(setup.cfg.seed)))[1])()
    rng = np.random.RandomState(1)
    return setup, jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), params)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_supported_shape_matches_transformers(shape: str, tmp_path: Path, hf) -> None:
    torch, transformers = hf
    arch, kw = SHAPES[shape]
    setup, params = _random_model(**kw)
    assert write_hf(tmp_path / "hf", setup.cfg.model, params, None, 0) == arch
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(model).__name__ == arch and not any(info.values()), info
    tokens = np.random.RandomState(0).randint(0, 300, (2, 64))
    diff = float(np.abs(_logits(setup, params, tokens) - _hf_logits(model, tokens, torch)).max())
    print(f"\n{shape}: max |logit difference| {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tensor_mapping_inverts_exactly(shape: str) -> None:
    arch, kw = SHAPES[shape]
    setup, params = _random_model(**kw)
    cfg = setup.cfg.model
    named = gather_params(params, cfg)
    tensors = hf_tensors(cfg, arch, named)
    back = minigpt_arrays(dataclasses.replace(cfg, bias=True) if arch == GPT2 else cfg, arch, tensors)
    for name, value in named.items():
        if name == "wte":
            value, back[name] = value[:300], back[name][:300]
        if name == "lm_head.kernel":
            value, back[name] = value[:, :300], back[name][:, :300]
        assert np.array_equal(value, back[name]), name
    extra = set(back) - set(named)  # GPT-2 without biases comes back with zero biases
    assert all(n.endswith(".bias") and not back[n].any() for n in extra)


def test_the_printed_train_command_rebuilds_the_imported_config_exactly() -> None:
    base = get_preset("cpu")
    model = dataclasses.replace(BASE, position="rope", norm="rmsnorm", activation="swiglu", bias=False,
                                rope_theta=5e5, dropout=0.1)  # fmt: skip
    data = DataConfig(
        paths=("a.txt", "b b.txt"), val_paths=("v.txt",), seq_len=64, tokenizer="gpt2", gpt2_dir="/t"
    )
    cfg = dataclasses.replace(base, run_dir="/runs/a b", model=model, data=data, optimizer=Lion(weight_decay=0.3),
                              schedule=WSDSchedule(), batch_size=16, seed=3)  # fmt: skip
    args = shlex.split(train_command(cfg))
    assert args[:4] == ["minigpt", "train", "--run-dir", "/runs/a b"]
    parsed = parse_train(args[2:], "minigpt train")
    assert to_dict(parsed) == to_dict(cfg) and not config_changes(cfg, parsed)


BASE = ModelConfig(vocab_size=300, d_model=32, n_heads=4, d_ff=64)
ROPE = dict(position="rope", norm="rmsnorm", activation="swiglu", bias=False)
RELU2 = {**ROPE, "activation": "relu2"}


@pytest.mark.parametrize(
    ("kw", "option"),
    [
        (dict(norm_position="post", activation="relu"), "model.norm_position=post"),
        ({**RELU2, "qk_norm": True, "value_residual": True}, "model.value_residual"),
        ({**RELU2, "qk_norm": True, "value_embeddings": 2}, "model.value_embeddings=2"),
        (dict(norm="rmsnorm"), "model.norm=rmsnorm"),
        (dict(activation="swiglu"), "model.activation=swiglu"),
        (dict(qk_norm=True), "model.qk_norm"),
        (dict(n_kv_heads=2), "model.n_kv_heads=2"),
        (dict(tie_embeddings=False, bias=True), "model.bias with untied embeddings"),
        ({**ROPE, "norm": "layernorm"}, "model.norm=layernorm"),
        ({**ROPE, "activation": "gelu"}, "model.activation=gelu"),
        ({**ROPE, "bias": True, "tie_embeddings": False}, "model.bias with untied embeddings"),
        ({**ROPE, "bias": True, "tie_embeddings": True, "qk_norm": True}, "model.bias with model.qk_norm"),
        # A plain MLP with RoPE is Apertus's, which always normalises queries and keys and has no MLP biases.
        (RELU2, "model.activation=relu2 with RoPE but without model.qk_norm (Apertus, the RoPE class with a plain MLP, always has QK-norm)"),
        ({**RELU2, "activation": "relu"}, "model.activation=relu with RoPE but without model.qk_norm"),
        ({**RELU2, "qk_norm": True, "bias": True, "tie_embeddings": True}, "model.bias with model.activation=relu2"),
        ({**RELU2, "qk_norm": True, "bias": True, "tie_embeddings": False}, "model.bias with untied embeddings"),
        ({**RELU2, "qk_norm": True, "norm": "layernorm"}, "model.norm=layernorm"),
        ({**RELU2, "qk_norm": True, "qkv_bias": True}, "model.qkv_bias with model.activation=relu2"),
        ({**ROPE, "qk_norm": True, "qkv_bias": True}, "model.qkv_bias with model.qk_norm"),
        (dict(head_dim=16, tie_embeddings=True), "model.head_dim=16 with learned positions"),
    ],
)  # fmt: skip
def test_architectures_without_a_transformers_equivalent_are_refused(kw: dict, option: str) -> None:
    with pytest.raises(ConfigError, match="cannot export to transformers") as e:
        hf_architecture(dataclasses.replace(BASE, **kw))
    assert option in str(e.value) and "\n" not in str(e.value)


def test_the_cpu_presets_block_exports_as_apertus_and_its_config_imports_back() -> None:
    cpu = dataclasses.replace(get_preset("cpu").model, vocab_size=300)
    assert hf_architecture(cpu) == APERTUS
    config = hf_config(cpu, APERTUS, 0)
    assert config["hidden_act"] == "relu2" and config["rope_parameters"] == {"rope_type": "default", "rope_theta": cpu.rope_theta}  # fmt: skip
    model, arch = model_config_from_hf(json.loads(json.dumps(config)))
    assert arch == APERTUS and _same_function(model, cpu)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_act": "xielu"}, "hidden_act='xielu' (minigpt's plain MLP is ReLU², ReLU or tanh GELU)"),
        ({"hidden_act": None}, "hidden_act='xielu'"),  # absent: Apertus's default
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 12e6, "factor": 8.0}}, "RoPE scaling 'yarn' has no minigpt equivalent"),
        ({"attention_bias": True}, "attention_bias (Apertus's MLP has no biases)"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)  # fmt: skip
def test_apertus_checkpoints_minigpt_cannot_compute_are_refused_in_one_line(change: dict, named: str) -> None:
    config = hf_config(dataclasses.replace(get_preset("cpu").model, vocab_size=300), APERTUS, 0) | change
    config = {k: v for k, v in config.items() if not (k in change and v is None)}  # None: absent
    with pytest.raises(ConfigError, match="cannot import") as e:
        model_config_from_hf(config)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_apertus_without_a_rope_setting_gets_its_config_classs_llama3_scaling() -> None:
    config = hf_config(dataclasses.replace(get_preset("cpu").model, vocab_size=300), APERTUS, 0)
    config = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    model, _ = model_config_from_hf(config)
    assert (model.rope_scaling, model.rope_theta, model.rope_factor) == ("llama3", 12e6, 8.0)


CHAT_ARCHS = {
    # Llama 3.1's RoPE scaling, heads twice d_model / n_heads wide, rms_norm_eps 1e-6.
    LLAMA: dict(head_dim=32, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    QWEN2: dict(rope_theta=1e6),  # biases on q, k and v only
    QWEN3: dict(head_dim=32),
}  # fmt: skip


@pytest.mark.parametrize("arch", list(CHAT_ARCHS))
def test_an_open_chat_checkpoint_imports_as_it_is(arch: str, root, hf) -> None:
    """A chat model as transformers saves one (its own byte-level BPE with a BOS, eos <|im_end|> and
    <|end_of_text|>, rms_norm_eps 1e-6): imported without a refusal, it computes transformers' logits, its
    tokenizer keeps the model's conventions, and the printed command trains it with that tokenizer."""
    from fixtures.checkpoints import BOS, EOS, IM_END, chat_checkpoint

    torch, _ = hf
    folder = root / f"chat-{arch}"
    model = chat_checkpoint(folder, hf, arch, **CHAT_ARCHS[arch])
    run, imported_arch, command = import_hf(folder, root / f"imported-chat-{arch}")
    assert imported_arch == arch and "--data.tokenizer hf" in command
    setup, params, tok, _ = load_model(run)
    assert setup.cfg.model.norm_eps == 1e-6
    ids = {t: tok.tok.token_to_id(t) for t in (BOS, EOS, IM_END)}
    assert (tok.bos_id, tok.eot_id, tok.stop_ids) == (
        ids[BOS],
        ids[IM_END],
        tuple(sorted((ids[EOS], ids[IM_END]))),
    )
    tokens = np.array([[tok.bos_id, *tok.encode("Tom saw a big red ball. Lily went to the park.")]], np.int32)
    diff = float(np.abs(_logits(setup, params, tokens) - _hf_logits(model.eval(), tokens, torch)).max())
    print(f"\ntransformers-made {arch} chat model: max |logit difference| {diff:.3g}")
    assert diff <= TOL


def test_a_chat_checkpoint_trained_here_exports_with_its_tokenizer_template_and_stop_ids(root, hf) -> None:
    """Imported and exported again, a chat model's folder is the checkpoint as transformers reads it: its own
    tokenizer (the BOS it adds, the ids), its chat template, its eos ids; imported once more, the same
    tokenizer and weights."""
    from fixtures.checkpoints import chat_checkpoint

    _, transformers = hf
    folder = root / "chat-roundtrip"
    chat_checkpoint(folder, hf)
    run, _, _ = import_hf(folder, root / "chat-roundtrip-run")
    out, _ = export_hf(run, root / "chat-roundtrip-hf")
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(f) for f in (out, folder))
    text = "Tom saw a big red ball."
    assert (
        ours(text).input_ids == theirs(text).input_ids and ours.eos_token == theirs.eos_token == "<|im_end|>"
    )
    messages = [{"role": "user", "content": text}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(
        messages, tokenize=False
    )
    expected = json.loads((folder / "config.json").read_text())["eos_token_id"]
    assert sorted(json.loads((out / "generation_config.json").read_text())["eos_token_id"]) == sorted(
        expected
    )
    again, _, _ = import_hf(out, root / "chat-roundtrip-again")
    (_, p1, t1, _), (_, p2, t2, _) = load_model(run), load_model(again)
    assert t1.identity == t2.identity
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True))


@pytest.mark.parametrize(
    ("content", "why"), [("{not json", "Expecting property name"), ("[1, 2]", "not a JSON object")]
)
def test_an_unreadable_minigpt_config_in_a_folder_is_one_line(tmp_path: Path, content: str, why: str) -> None:
    """A folder minigpt exported keeps the run's config; damaged, import names it and the way out."""
    setup, params = _random_model(**SHAPES["gpt2-relu"][1])
    write_hf(tmp_path / "hf", setup.cfg.model, params, None, 0)
    (tmp_path / "hf" / MINIGPT_CONFIG).write_text(content)
    with pytest.raises(ConfigError) as e:
        import_hf(tmp_path / "hf", tmp_path / "run")
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'hf' / MINIGPT_CONFIG} is not a readable minigpt config (")
    assert why in message and "delete it to import the weights with the finetune preset's config" in message
    assert "\n" not in message


def test_export_and_import_errors_are_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    tutorial = tmp_path / "tutorial"  # the tutorial preset's post-norm blocks (refused before any weights)
    tutorial.mkdir()
    save_json(get_preset("tutorial"), str(tutorial / "config.json"))
    err = cli_error(
        capsys, ["export", "--run", str(tutorial), "--format", "hf", "--out", str(tmp_path / "x")]
    )
    assert "model.norm_position=post" in err and not (tmp_path / "x").exists()
    err = cli_error(capsys, ["export", "--run", str(tmp_path / "missing"), "--format", "hf", "--out", str(tmp_path / "y")])  # fmt: skip
    assert "is neither a run directory (no config.json) nor an export" in err

    folder = tmp_path / "hf"
    setup, params = _random_model(activation="relu", tie_embeddings=True)
    write_hf(folder, setup.cfg.model, params, None, 0)
    with pytest.raises(ConfigError, match="exists; pass --overwrite"):
        write_hf(folder, setup.cfg.model, params, None, 0)
    write_hf(folder, setup.cfg.model, params, None, 0, overwrite=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a transformers checkpoint folder"):
        write_hf(tmp_path / "notes", setup.cfg.model, params, None, 0, overwrite=True)
    assert (tmp_path / "notes" / "keep.txt").is_file()

    err = cli_error(capsys, ["import", "--hf", str(folder), "--out", str(tmp_path / "r")])
    assert "has no tokenizer minigpt can use" in err
    err = cli_error(capsys, ["import", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r")])
    assert "is not a transformers checkpoint folder (no config.json)" in err
    err = cli_error(capsys, ["import", "--hf", str(folder), "--out", str(tutorial)])
    assert "exists; pass --overwrite to replace it" in err
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    err = cli_error(capsys, ["import", "--hf", str(folder), "--out", str(tmp_path / "r")])
    assert "cannot import a MistralForCausalLM checkpoint" in err
    (folder / "config.json").write_text(json.dumps({**config, "activation_function": "gelu"}))
    err = cli_error(capsys, ["import", "--hf", str(folder), "--out", str(tmp_path / "r")])
    assert "activation_function='gelu'" in err and not (tmp_path / "r").exists()


def test_a_torn_or_garbled_safetensors_file_is_one_line_naming_it(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """model.safetensors cut short (a copy or download interrupted) or with a garbage header: `minigpt import`
    names the file, never an error from deep in numpy or json."""
    docs = ["Tom saw a big red ball. He was happy.", "Lily and Ben played in the park all day."] * 30
    tok = BPETokenizer.train(docs, 300)
    setup, params = _random_model(activation="relu", tie_embeddings=True)
    folder = tmp_path / "hf"
    write_hf(folder, setup.cfg.model, params, tok, tok.eot_id)
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    fix = "copy or download it again, or re-save it with model.save_pretrained(DIR)"
    argv = ["import", "--hf", str(folder), "--out", str(tmp_path / "run")]

    weights.write_bytes(raw[: len(raw) // 2])
    err = cli_error(
        capsys, argv
    )  # "(truncated: transformer.h.1.mlp.c_fc.weight ends at byte 62,616, the file ...)"
    assert err.startswith(f"minigpt: error: {weights} is not a readable safetensors file (truncated: "), err
    assert err.endswith(f", the file has {len(raw) // 2:,}); {fix}"), err
    weights.write_bytes(b"\xff" * 8 + raw[8:])  # a header length no file has
    assert cli_error(capsys, argv) == (
        f"minigpt: error: {weights} is not a readable safetensors file (its header claims "
        f"18,446,744,073,709,551,615 bytes, the file has {len(raw):,}: truncated or not safetensors); {fix}"
    )
    weights.write_bytes(raw[:8] + b"#" * 32 + raw[40:])  # the header's JSON overwritten
    assert cli_error(capsys, argv) == (
        f"minigpt: error: {weights} is not a readable safetensors file (its header is not JSON: damaged, or "
        f"not a safetensors file); {fix}"
    )
    assert not (tmp_path / "run").exists()
    weights.write_bytes(raw)
    (folder / "config.json").write_text("{")
    assert cli_error(capsys, argv) == (
        f"minigpt: error: {folder / 'config.json'} is not a readable transformers config (Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1))"
    )


SHARDED_WORKER = """
import dataclasses, json, tempfile
import jax, numpy as np
from safetensors.numpy import load_file, save_file
from minigpt.parallel import sharding
from minigpt.config import DataConfig, MeshConfig, ModelConfig, TrainConfig
from minigpt.hf import write_hf
from minigpt.training.trainer import build, init_state

mc = ModelConfig(vocab_size=300, max_seq_len=32, d_model=64, n_layers=2, n_heads=4, d_ff=128, position="rope",
                 norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2, scan_layers=True)
cfg = TrainConfig(model=mc, data=DataConfig(seq_len=16), batch_size=8,
                  mesh=MeshConfig(data=1, fsdp=4, tensor=2, fsdp_min_mbytes=0))
setup = build(cfg)
params = init_state(setup).params
shards = max(len(x.sharding.device_set) for x in jax.tree.leaves(params))
sharded, local = tempfile.mkdtemp() + "/a", tempfile.mkdtemp() + "/b"
write_hf(sharded, mc, params, None, 0)
write_hf(local, mc, jax.tree.map(np.asarray, params), None, 0)
a, b = load_file(sharded + "/model.safetensors"), load_file(local + "/model.safetensors")
print(json.dumps({"shards": shards, "same": a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a),
                  "layers": sorted({k.split(".")[2] for k in a if k.startswith("model.layers.")})}))
"""


@pytest.mark.slow
def test_export_gathers_parameters_sharded_over_fsdp_and_tensor_axes() -> None:
    out = run_on_devices(SHARDED_WORKER)
    assert out["shards"] == 8 and out["same"] and out["layers"] == ["0", "1"]
