"""A trained run wherever it lives (runs.py): a transformers checkpoint folder passed as a run is refused in one
line that says to import it, an export's config (with its step) reads back, and a damaged one is named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_error

from minigpt.config import ConfigError, DataConfig, ModelConfig, get_preset, to_dict
from minigpt.data.tokenizer import BPETokenizer
from minigpt.hf import import_hf, write_hf
from minigpt.training.runs import export, load_model, run_config
from minigpt.training.trainer import build, init_state

DOCS = ["Tom saw a big red ball. He was happy.", "Lily and Ben played in the park all day."] * 30


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers checkpoint folder as `minigpt export --format hf` writes it (config.json with
    "architectures", model.safetensors, tokenizer files, minigpt_config.json), of a small random GPT-2."""
    tok = BPETokenizer.train(DOCS, 300)
    model = ModelConfig(vocab_size=tok.vocab_size, max_seq_len=32, d_model=32, n_layers=1, n_heads=4, d_ff=64,
                        tie_embeddings=True)  # fmt: skip
    data = DataConfig(seq_len=16, tokenizer="bpe", bpe_vocab_size=300)
    cfg = dataclasses.replace(get_preset("cpu"), model=model, data=data, batch_size=2)
    params = init_state(build(cfg)).params
    folder = tmp_path_factory.mktemp("runs") / "hf"
    extra = {**to_dict(cfg), "step": 0, "tokenizer_identity": tok.identity}
    write_hf(folder, model, params, tok, tok.eot_id, extra)
    return folder


def test_a_transformers_folder_passed_as_a_run_says_to_import_it(
    hf_folder: Path, capsys: pytest.CaptureFixture
) -> None:
    assert json.loads((hf_folder / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    message = (
        f"{hf_folder} is a transformers checkpoint folder, not a minigpt run; import it with "
        f"`minigpt import --hf {hf_folder} --out RUN`, then pass --run RUN"
    )
    for argv in (["generate", "--run", str(hf_folder)], ["eval", "--run", str(hf_folder)]):
        assert cli_error(capsys, argv) == f"minigpt: error: {message}"
    for read in (run_config, load_model):
        with pytest.raises(ConfigError) as e:
            read(hf_folder)
        assert str(e.value) == message


def test_an_export_reads_back_with_its_step_and_a_damaged_one_is_named(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run, _, _ = import_hf(hf_folder, tmp_path / "run")  # the export's minigpt_config.json comes back
    out = export(run, tmp_path / "model.npz")
    cfg = run_config(run)
    assert run_config(out) == cfg and cfg.batch_size == 2  # the original run's config, not the cpu preset's
    assert load_model(out)[3] == 0

    with np.load(out) as z:
        arrays = dict(z)
    config = json.loads(arrays["config"].tobytes())
    arrays["config"] = np.frombuffer(json.dumps({**config, "zloss": 1e-4}).encode(), np.uint8)
    np.savez(tmp_path / "future.npz", **arrays)
    assert cli_error(capsys, ["generate", "--run", str(tmp_path / "future.npz")]) == (
        f"minigpt: error: {tmp_path / 'future.npz'} holds a config that is not a readable minigpt config "
        "(unknown key 'zloss' (from another minigpt version?)); export the run again with "
        "`minigpt export --run RUN --out FILE`"
    )

    # An OSError no check anticipated (--out inside /proc, or under a regular file) is one line naming the
    # file (`minigpt: error: No such file or directory: /proc/...`), exit 2 (`_error` checks the one line).
    err = cli_error(capsys, ["export", "--run", str(run), "--out", "/proc/minigpt-test.npz"])
    assert err.startswith("minigpt: error: No such file or directory: /proc/minigpt-test"), err
    (tmp_path / "file").write_text("not a folder")
    err = cli_error(capsys, ["export", "--run", str(run), "--out", str(tmp_path / "file" / "model.npz")])
    assert str(tmp_path / "file") in err, err


def test_a_run_records_the_extent_it_reads_and_older_records_read_whole_splits(tmp_path: Path) -> None:
    from conftest import DOCS, data_cfg, write_corpus

    from minigpt.data.mixture import prepare_corpus
    from minigpt.training.runs import DATA_FILE, record_data, recorded_extent

    assert recorded_extent(tmp_path) is None  # a new run
    corpus = prepare_corpus(data_cfg(write_corpus(tmp_path / "c.txt", DOCS), tmp_path / "cache"))
    record_data(tmp_path, corpus)
    sizes = {s: corpus.first.meta["splits"][s]["tokens"] for s in ("train", "val")}
    assert recorded_extent(tmp_path) == {"": sizes}
    record = json.loads((tmp_path / DATA_FILE).read_text())
    (tmp_path / DATA_FILE).write_text(json.dumps({k: v for k, v in record.items() if k != "extent"}))
    assert recorded_extent(tmp_path) == {}  # before extents were recorded: the whole splits, as then
    (tmp_path / DATA_FILE).write_text(json.dumps({**record, "extent": {"": {"train": "x"}}}))
    with pytest.raises(ConfigError, match="is unreadable"):
        recorded_extent(tmp_path)


def test_a_run_on_conversations_recorded_before_stores_named_their_template_still_resumes(
    tmp_path: Path, hf
) -> None:
    """A store of conversations is named by its chat template now; a run that recorded the store's identity
    from before (without it) is still let through, and any other identity is still refused."""
    from fixtures.checkpoints import chat_tokenizer, conversations
    from minigpt.data.mixture import prepare_corpus
    from minigpt.data.store import store_identity
    from minigpt.training.runs import DATA_FILE, check_data, record_data

    chat_tokenizer(tmp_path / "tok", hf[1])
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in conversations(12)))
    cfg = DataConfig(paths=(str(chat),), tokenizer="hf", hf_tokenizer=str(tmp_path / "tok"),
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    corpus = prepare_corpus(cfg)
    meta = corpus.first.meta
    before = store_identity(
        {**meta, "options": {k: v for k, v in meta["options"].items() if k != "rendering"}}
    )
    assert "rendering" in meta["options"] and before != corpus.identity
    (tmp_path / "run").mkdir()
    record_data(tmp_path / "run", corpus)
    record = json.loads((tmp_path / "run" / DATA_FILE).read_text())
    for identity, ok in ((corpus.identity, True), (before, True), ("0" * 16, False)):
        (tmp_path / "run" / DATA_FILE).write_text(json.dumps({**record, "store_identity": identity}))
        if ok:
            check_data(tmp_path / "run", corpus)
        else:
            with pytest.raises(ConfigError, match="other files, reading options or chat template"):
                check_data(tmp_path / "run", corpus)


def test_a_run_whose_tokenizer_was_changed_is_refused_by_what_samples_or_scores_it(
    hf_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`generate` (and everything that loads a run) refuses a tokenizer/ that is not the one the newest
    checkpoint recorded, as `minigpt check` does, rather than sample text through other ids."""
    import shutil

    run, _, _ = import_hf(hf_folder, tmp_path / "run")
    assert load_model(run)[2].identity == BPETokenizer.load(run / "tokenizer").identity
    other = BPETokenizer.train([d.upper() for d in DOCS], 300)
    shutil.rmtree(run / "tokenizer")
    other.save(run / "tokenizer")
    err = cli_error(capsys, ["generate", "--run", str(run), "--prompt", "Tom", "--max-new-tokens", "2"])
    assert f"the run's tokenizer ({run / 'tokenizer'}) is {other.identity}, not bpe300-" in err
    assert "the one its newest checkpoint was trained with" in err


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_a_lora_model_folded_computes_what_its_adapters_compute(scan: bool) -> None:
    """`folded` gives the plain model (no adapters in its graph) whose logits are the adapted model's: what
    `minigpt serve` decodes with."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from minigpt.config import LoRAConfig
    from minigpt.nn.model import GPT
    from minigpt.training.runs import folded

    cfg = ModelConfig(vocab_size=50, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64, scan_layers=scan,
                      lora=LoRAConfig(rank=4, alpha=8.0))  # fmt: skip
    graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
    # B starts at zero (the base model exactly): give the adapters something to add.
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(len(str(p))), x.shape)
        if "lora_b" in jax.tree_util.keystr(p) else x, params)  # fmt: skip
    plain_graph, plain = folded(cfg, params)
    assert not any("lora" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(plain))
    tokens = jnp.arange(12)[None] % 50
    run = jax.jit(lambda g, p: nnx.merge(g, p)(tokens), static_argnums=0)
    theirs, ours = run(graphdef, params), run(plain_graph, plain)
    assert float(jnp.abs(theirs - ours).max()) < 1e-4 and float(jnp.abs(theirs).max()) > 0.1
