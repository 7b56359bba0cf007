"""Reading a token store: the stores prepare refuses to reuse, a reader noticing its store was rebuilt, and a
split's opening as a prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DOCS, data_cfg, raises_config_error, write_corpus

from minigpt.config import ConfigError
from minigpt.data.build import prepare
from minigpt.data.tokenizer import BPETokenizer


def test_a_store_from_another_tokenizer_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    cfg = data_cfg(corpus, tmp_path / "cache")
    store = prepare(cfg)
    meta = json.loads((store.path / "meta.json").read_text())
    meta["tokenizer"]["request"], meta["tokenizer"]["identity"] = "gpt2", "gpt2"
    (store.path / "meta.json").write_text(json.dumps(meta))
    with raises_config_error(
        f"token store {store.path} holds tokens of tokenizer gpt2, but the config asks for bpe300"
    ):
        prepare(cfg)
    meta["tokenizer"]["request"] = "bpe300"
    (store.path / "meta.json").write_text(json.dumps(meta))
    BPETokenizer.train(["other text entirely"] * 20, 280).save(store.path / "tokenizer")
    with raises_config_error("tokenizer/ is not the tokenizer its tokens were made with"):
        prepare(cfg)


def test_a_store_rebuilt_by_another_process_is_noticed_by_its_reader(tmp_path: Path) -> None:
    """A running job holds a TokenStore; if another process prepares the same data path again after a source
    changed, the job's next read of it (each evaluation) refuses to go on with other tokens."""
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    cfg = data_cfg(corpus, tmp_path / "cache")
    running = prepare(cfg)
    running.check_unchanged()
    prepare(cfg).check_unchanged()  # prepared again, same sources: the same tokens, nothing to say
    assert prepare(cfg).identity == running.identity
    write_corpus(corpus, [*DOCS, "A story nobody had read before."])
    rebuilt = prepare(cfg)
    assert rebuilt.identity != running.identity
    with pytest.raises(ConfigError, match="was rebuilt by another process while this run used it"):
        running.check_unchanged()


def test_the_opening_of_a_validation_document_is_the_default_sample_prompt(tmp_path: Path) -> None:
    """Samples continue text in the corpus's own style, not a fixed fairy-tale opening."""
    train = write_corpus(tmp_path / "train.txt", DOCS)
    val = write_corpus(
        tmp_path / "val.txt", ["\n", "?", "Thou art more lovely and more temperate, rough winds do shake"]
    )
    store = prepare(data_cfg(train, tmp_path / "cache", val_paths=(str(val),)))
    # The first document with words, past the "?" a split can leave at the start of a validation text.
    assert store.opening("val") == "Thou art more lovely and more"
    assert store.opening("val", words=2) == "Thou art"


def test_sha256_of_hashes_files_in_turn_and_a_pair_as_the_files_first_bytes(tmp_path: Path) -> None:
    """A build records a split's token files' sha256; `check` hashes just the recorded length of a token file
    a later build may have extended, with the same function."""
    import hashlib

    from minigpt.data.store import sha256_of

    a, b = tmp_path / "a.bin", tmp_path / "b.npy"
    a.write_bytes(bytes(range(256)) * 300)
    b.write_bytes(b"starts")
    assert sha256_of(a, b) == hashlib.sha256(a.read_bytes() + b"starts").hexdigest()
    assert sha256_of((a, 1000), b) == hashlib.sha256(a.read_bytes()[:1000] + b"starts").hexdigest()
    assert sha256_of((a, 0)) == hashlib.sha256(b"").hexdigest()
    with pytest.raises(ConfigError, match="could not be read"):
        sha256_of(tmp_path / "missing.bin")
