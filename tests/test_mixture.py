"""Mixtures: named sources with weights, one shared tokenizer, each source's store reused when only the weights
change, validation bits per byte per source and in total; the command line end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import TINY_FLAGS, cli_error, data_cfg, raises_config_error, write_corpus

from minigpt.cli import main
from minigpt.config import DataConfig, ModelConfig, TrainConfig
from minigpt.data.mixture import Corpus, prepare_corpus
from minigpt.inference.evaluate import _eval_totals, evaluate
from minigpt.training.metrics import bits_per_byte
from minigpt.training.trainer import build, init_state, make_eval_step, resolve_model


def _two_sources(tmp_path: Path) -> tuple[Path, Path]:
    stories = [f"Tom saw a red ball {i}. They played all day. The end." for i in range(150)]
    letters = [
        f"Dear Sir, I write to you of the weather on day {i}; it rained, and rained again." for i in range(80)
    ]
    return write_corpus(tmp_path / "stories.txt", stories), write_corpus(tmp_path / "letters.txt", letters)


def _mixture_cfg(tmp_path: Path, a: Path, b: Path, wa: float, wb: float) -> DataConfig:
    one = data_cfg(a, tmp_path / "cache", seq_len=16)
    return dataclasses.replace(one, paths=(f"stories={a}:{wa}", f"letters={b}:{wb}"))


def test_sources_share_one_bpe_and_new_weights_reuse_their_stores(tmp_path: Path) -> None:
    a, b = _two_sources(tmp_path)
    first = prepare_corpus(_mixture_cfg(tmp_path, a, b, 0.7, 0.3))
    assert [(p.name, round(p.weight, 6)) for p in first.parts] == [("stories", 0.7), ("letters", 0.3)]
    identities = {p.store.meta["tokenizer_identity"] for p in first.parts}
    assert len(identities) == 1  # one vocabulary: a token means the same thing in every source
    # the BPE saw both sources: each one's words are single tokens or close to it
    tok = first.tokenizer()
    assert len(tok.encode(" rained")) == 1 and len(tok.encode(" played")) == 1
    built = [p.store.meta["build"]["seconds"] for p in first.parts]
    again = prepare_corpus(_mixture_cfg(tmp_path, a, b, 1, 3))
    assert [p.store.path for p in again.parts] == [p.store.path for p in first.parts]
    assert [p.store.meta["build"]["seconds"] for p in again.parts] == built  # not tokenized again
    assert [p.weight for p in again.parts] == [0.25, 0.75]
    assert again.identity == first.identity  # the same tokens (the weights are the config's)
    assert first.identity != prepare_corpus(data_cfg(a, tmp_path / "cache", seq_len=16)).identity


def test_evaluation_reports_each_source_and_the_bytes_weighted_total(tmp_path: Path) -> None:
    a, b = _two_sources(tmp_path)
    data = _mixture_cfg(tmp_path, a, b, 0.5, 0.5)
    corpus = prepare_corpus(data)
    model = ModelConfig(d_model=32, n_heads=4, n_layers=1, d_ff=64, max_seq_len=32)
    cfg = TrainConfig(model=model, data=data, batch_size=4, run_dir=str(tmp_path / "run"))
    cfg = resolve_model(cfg, corpus.vocab_size, corpus.tokenizer().eot_id)
    setup = build(cfg)
    params = init_state(setup).params
    step = make_eval_step(setup, corpus.tokenizer().token_bytes())
    result = evaluate(setup, step, params, corpus)
    parts = {p.name: _eval_totals(setup, step, params, p.store, 0) for p in corpus.parts}
    for name, t in parts.items():
        assert result[f"bpb/{name}"] == pytest.approx(bits_per_byte(t["nll_bytes"], t["bytes"]), rel=1e-9)
    total = bits_per_byte(
        sum(t["nll_bytes"] for t in parts.values()), sum(t["bytes"] for t in parts.values())
    )
    assert result["bpb"] == pytest.approx(total, rel=1e-9)
    assert (
        min(result["bpb/stories"], result["bpb/letters"])
        < result["bpb"]
        < max(result["bpb/stories"], result["bpb/letters"])
    )
    alone = Corpus((dataclasses.replace(corpus.parts[0], name=""),))  # one corpus: no per-source figures
    assert set(evaluate(setup, step, params, alone)) == {"loss", "bpb", "tokens"}


def test_mixture_flags_are_checked_before_any_data_is_read() -> None:
    with raises_config_error(
        "--data mixes named sources (NAME=PATH) with a plain path (b.txt); name every one"
    ):
        DataConfig(paths=("a=a.txt", "b.txt"))
    with raises_config_error("--data a=a.txt:0: the weight of source 'a' must be a finite positive number"):
        DataConfig(paths=("a=a.txt:0",))
    with raises_config_error("--val-data names 'c', which is no --data source"):
        DataConfig(paths=("a=a.txt", "b=b.txt"), val_paths=("c=c.txt",))
    spec = DataConfig(paths=("a=x/a.txt:3", "b=b.txt"), val_paths=("b=bv.txt",)).sources()
    assert [(s.name, s.paths, s.weight, s.val_paths) for s in spec] == [
        ("a", ("x/a.txt",), 0.75, ()),
        ("b", ("b.txt",), 0.25, ("bv.txt",)),
    ]
    absolute = DataConfig(paths=("a=x/a.txt:3", "b=b.txt")).absolute().paths
    assert absolute == (f"a={Path('x/a.txt').absolute()}:3", f"b={Path('b.txt').absolute()}")


@pytest.mark.slow
def test_train_on_a_mixture_with_document_attention_reports_each_source(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a, b = _two_sources(tmp_path)
    run = tmp_path / "run"
    common = ["--data.cache-dir", str(tmp_path / "cache"), "--run-dir", str(run), *TINY_FLAGS]
    main([  # the commands in this process: an error exits, failing the test
        "train", "--data", f"stories={a}:0.6", f"letters={b}:0.4", *common, "--steps", "4", "--eval-every", "2",
        "--model.document-attention", "--data.window-start", "document", "--sample-tokens", "4",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "source stories: weight 0.6" in out and "bpb/letters" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r.get("kind") == "val"]
    assert [r["step"] for r in val] == [2, 4]
    assert all({"bpb/stories", "bpb/letters", "bpb"} <= set(r) for r in val)
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["document_attention"] and saved["model"]["eot_id"] >= 0
    main(["eval", "--run", str(run)])
    out = capsys.readouterr().out
    assert "bpb/stories" in out and "bpb/letters" in out
    line = cli_error(capsys, ["train", "--data", f"stories={a}:0.6", *common, "--steps", "6"])
    assert f"{run} trained on the sources 'letters', 'stories', and this --data drops 'letters'; " in line


@pytest.mark.parametrize("weight", ["-1", "nan", "inf", "-inf", "1e400", "+0"])
def test_a_weight_that_is_no_finite_positive_number_is_named_as_the_weight(
    weight: str, capsys: pytest.CaptureFixture
) -> None:
    line = cli_error(capsys, ["train", "--data", f"small=small.txt:{weight}", "big=big.txt"])
    assert f"--data small=small.txt:{weight}: the weight of source 'small' must be a finite positive" in line
    with raises_config_error("the mixture's weights sum past the largest float"):
        DataConfig(paths=("a=a.txt:1e308", "b=b.txt:1e308"))


def test_an_existing_file_named_like_a_source_is_read_as_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("k=v.txt").write_text("text")
    Path("notes.txt:2").write_text("text")
    (source,) = DataConfig(paths=("k=v.txt",)).sources()
    assert (source.name, source.paths) == ("", ("k=v.txt",))
    assert DataConfig(paths=("k=v.txt",)).absolute().paths == (str(tmp_path / "k=v.txt"),)
    a, b = DataConfig(paths=("a=notes.txt:2", "b=other.txt:3")).sources()  # the file named with a colon
    assert (a.paths, b.paths, a.weight) == (("notes.txt:2",), ("other.txt",), 0.25)
    (named,) = DataConfig(paths=("k=w.txt",)).sources()  # no such file: a source named k, as before
    assert (named.name, named.paths) == ("k", ("w.txt",))
