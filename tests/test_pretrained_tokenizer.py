"""A checkpoint's own tokenizer tokenizes corpora as transformers does, with the model's BOS and end-of-text,
bytes counted exactly, and its token stores named by its content."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import data_cfg, raises_config_error, write_corpus

from fixtures.checkpoints import BOS, DOCS, EOS, IM_END, chat_tokenizer
from minigpt.data.build import prepare
from minigpt.data.pretrained_tokenizer import PretrainedTokenizer
from minigpt.data.saved_tokenizer import load_tokenizer, open_pretrained


@pytest.fixture(scope="module")
def transformers(hf):
    return hf[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, transformers) -> Path:
    """A Llama 3 style tokenizer folder, as transformers saves it, with the model's config naming its eos ids."""
    out = tmp_path_factory.mktemp("chat-tokenizer")
    tok = chat_tokenizer(out, transformers)
    ids = [tok.convert_tokens_to_ids(t) for t in (IM_END, EOS)]
    (out / "config.json").write_text(json.dumps({"eos_token_id": ids}))
    return out


TEXTS = [*DOCS, "A cat typed <|im_end|> and <|begin_of_text|> as words.", "naïve café, 東京 🙂"]


def test_the_checkpoints_conventions_are_read_from_its_files(folder: Path) -> None:
    tok = PretrainedTokenizer.from_checkpoint(folder)
    ids = {t: tok.tok.token_to_id(t) for t in (BOS, EOS, IM_END)}
    assert tok.bos_id == ids[BOS]  # tokenizer.json's post-processor puts it before every text
    assert tok.eot_id == ids[IM_END]  # tokenizer_config.json's eos_token ends a document
    assert tok.stop_ids == tuple(sorted({ids[IM_END], ids[EOS]}))  # config.json's eos ids stop generation


def test_texts_encode_as_transformers_encodes_them_and_bytes_add_up(folder: Path, transformers) -> None:
    """Without special tokens, ids equal AutoTokenizer's; with them, transformers puts the same BOS in front.
    Text that spells a special token stays text, and every token's bytes add up to the text's."""
    tok = PretrainedTokenizer.from_checkpoint(folder)
    auto = transformers.AutoTokenizer.from_pretrained(folder, split_special_tokens=True)
    table = tok.token_bytes()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == auto(text, add_special_tokens=False).input_ids
        assert [tok.bos_id, *ids] == auto(text).input_ids
        assert int(table[ids].sum()) == len(text.encode()) and tok.decode(ids) == text
    assert table[tok.bos_id] == table[tok.eot_id] == 0


def test_a_store_holds_each_document_between_bos_and_end_of_text(folder: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", TEXTS * 4)
    store = prepare(
        data_cfg(corpus, tmp_path / "cache", tokenizer="hf", hf_tokenizer=str(folder), seq_len=16)
    )
    tok = PretrainedTokenizer.from_checkpoint(folder)
    both = np.concatenate([store.tokens("train"), store.tokens("val")])
    docs = np.split(both, np.flatnonzero(both == tok.eot_id)[:-1] + 1)
    assert all(d[0] == tok.bos_id and d[-1] == tok.eot_id for d in docs)
    assert sorted(tok.decode(d[1:-1]).strip() for d in docs) == sorted(TEXTS * 4)
    meta = store.meta["splits"]
    assert sum(s["text_bytes"] for s in meta.values()) == sum(len(t.encode()) for t in TEXTS * 4)


def test_the_store_is_named_by_the_tokenizers_content_not_its_folder(folder: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", TEXTS * 4)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    cfg = lambda f: data_cfg(corpus, tmp_path / "cache", tokenizer="hf", hf_tokenizer=str(f), seq_len=16)
    assert prepare(cfg(folder)).path == prepare(cfg(copy)).path
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": EOS}))
    assert prepare(cfg(copy)).path != prepare(cfg(folder)).path  # another end-of-text: other tokens


def test_saved_and_loaded_it_is_the_same_tokenizer(folder: Path, tmp_path: Path) -> None:
    tok = PretrainedTokenizer.from_checkpoint(folder)
    tok.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.identity == tok.identity == open_pretrained(tmp_path / "saved").identity
    assert (again.bos_id, again.eot_id, again.stop_ids) == (tok.bos_id, tok.eot_id, tok.stop_ids)


def test_what_it_cannot_use_is_refused_in_one_line(folder: Path, tmp_path: Path, transformers) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    word = tmp_path / "word"
    word.mkdir()
    level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    level.pre_tokenizer = pre_tokenizers.Whitespace()
    level.save(str(word / "tokenizer.json"))
    with raises_config_error("is neither a byte-level BPE"):
        PretrainedTokenizer.from_checkpoint(word)
    nameless = tmp_path / "nameless"
    chat_tokenizer(nameless, transformers)
    settings = json.loads((nameless / "tokenizer_config.json").read_text())
    (nameless / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": None}))
    with raises_config_error("names no end-of-text token"):
        PretrainedTokenizer.from_checkpoint(nameless)
    with raises_config_error("has no tokenizer.json"):
        PretrainedTokenizer.from_checkpoint(tmp_path)
    for garbled in ('{"model": {"type": "BPE"', '{"version": "1.0", "model": {"type": "Nope"}}'):
        (nameless / "tokenizer.json").write_text(garbled)
        with raises_config_error("the `tokenizers` library cannot read this tokenizer.json"):
            PretrainedTokenizer.from_checkpoint(nameless)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, hf) -> Path:
    from fixtures.checkpoints import chat_checkpoint

    out = tmp_path_factory.mktemp("checkpoint")
    chat_checkpoint(out, hf)
    return out


@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja"])
def test_a_checkpoint_file_that_is_not_utf8_is_named_in_one_line(
    checkpoint: Path, tmp_path: Path, capsys, name: str
) -> None:
    """`minigpt import --hf` of a folder whose tokenizer files hold invalid UTF-8: the file and the byte."""
    from conftest import cli_error

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "chat_template.jinja").write_text("{{ messages }}")
    (broken / name).write_bytes((broken / name).read_bytes() + b"\xff")
    err = cli_error(capsys, ["import", "--hf", str(broken), "--out", str(tmp_path / "run")])
    assert f"{broken / name} is not UTF-8 text (bad byte at offset" in err
    assert not (tmp_path / "run").exists()
