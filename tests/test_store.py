"""Token store: what prepare refuses, caching and rebuilding, the meta it records, BPE training on a bounded
prefix, and worker processes writing the same store as one process."""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path

import pytest
from conftest import DOCS, data_cfg, raises_config_error, stored_docs, write_corpus

import minigpt.store as store_mod
from minigpt.config import ConfigError, DataConfig
from minigpt.store import prepare
from minigpt.tokenizer import BPETokenizer

# -------------------------------------------------------------------------------------------------- bad input


def test_a_file_in_both_training_and_validation_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS[:5])
    with raises_config_error("c.txt is both training and validation data"):
        prepare(data_cfg(tmp_path, tmp_path / "cache", val_paths=(str(corpus),)))


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


# ---------------------------------------------------------------------------------------------------- caching


def test_prepare_is_cached_and_rebuilt_when_half_written(small_corpus: Path, tmp_path: Path) -> None:
    cfg = data_cfg(small_corpus, tmp_path)
    first = prepare(cfg)
    assert prepare(cfg).path == first.path
    (first.path / "meta.json").unlink()  # as if the process died before finishing
    (first.path / "train.bin").write_bytes(b"garbage")
    again = prepare(cfg)
    assert again.meta["complete"] and len(again.tokens("train")) == first.meta["splits"]["train"]["tokens"]


def test_unchanged_sources_are_not_read_again_and_changed_ones_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    cfg = data_cfg(corpus, tmp_path / "cache")
    first = prepare(cfg)
    build = store_mod._build

    def must_not_build(*a, **kw):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(store_mod, "_build", must_not_build)
    assert prepare(cfg).meta == first.meta  # the fast path: same path, size and mtime
    later = time.time() + 100
    os.utime(corpus, (later, later))  # touched, not changed: the sha256 says so
    assert prepare(cfg).meta["sources"]["train"][0]["mtime_ns"] == corpus.stat().st_mtime_ns
    write_corpus(corpus, [*DOCS, "one more document"])
    monkeypatch.setattr(store_mod, "_build", build)
    changed = prepare(cfg)
    assert changed.path == first.path
    assert sorted(stored_docs(changed, "train") + stored_docs(changed, "val")) == sorted(
        [*DOCS, "one more document"]
    )


def test_meta_records_sources_tokenizer_and_counts(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    store = prepare(data_cfg(corpus, tmp_path / "cache"))
    (src,) = store.meta["sources"]["train"]
    assert src["path"] == str(corpus.resolve()) and src["size"] == corpus.stat().st_size
    assert src["sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest() and src["documents"] == len(DOCS)
    tok = store.tokenizer()
    assert store.meta["tokenizer"]["identity"] == tok.identity == store.meta["tokenizer_identity"]
    assert (
        store.meta["tokenizer"]["vocab_hash"] == tok.vocab_hash
        and store.meta["tokenizer"]["request"] == "bpe300"
    )
    text_bytes = sum(len(d.encode()) for s in ("train", "val") for d in stored_docs(store, s))
    assert (
        store.meta["splits"]["train"]["text_bytes"] + store.meta["splits"]["val"]["text_bytes"] == text_bytes
    )


def test_a_different_tokenizer_gets_its_own_store(small_corpus: Path, cache_dir: str, gpt2_dir: Path) -> None:
    bpe = prepare(data_cfg(small_corpus, cache_dir))
    gpt2 = prepare(
        DataConfig(paths=(str(small_corpus),), tokenizer="gpt2", gpt2_dir=str(gpt2_dir), cache_dir=cache_dir)
    )
    assert bpe.path != gpt2.path
    assert gpt2.meta["tokenizer_identity"] == "gpt2" and gpt2.vocab_size == 50257


def test_bpe_trains_on_a_bounded_prefix_of_the_training_documents(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS[:100])
    val = write_corpus(tmp_path / "v.txt", DOCS[100:])
    budget = 2000
    store = prepare(data_cfg(corpus, tmp_path / "cache", val_paths=(str(val),), bpe_train_bytes=budget))
    sample, seen = [], 0
    for d in DOCS[:100]:
        sample.append(d)
        seen += len(d)
        if seen >= budget:
            break
    assert len(sample) < 100
    assert store.meta["tokenizer"]["identity"] == BPETokenizer.train(sample, 300).identity


@pytest.mark.slow
def test_worker_processes_write_the_same_store_as_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS * 5)
    monkeypatch.setattr(store_mod, "CHUNK_CHARS", 2000)  # many chunks in flight, completing out of order
    one = prepare(data_cfg(corpus, tmp_path / "a", tokenize_workers=1))
    two = prepare(data_cfg(corpus, tmp_path / "b", tokenize_workers=2))
    assert two.meta["build"]["workers"] == 2
    for name in ("train.bin", "val.bin", "train.docs.npy", "val.docs.npy"):
        assert (one.path / name).read_bytes() == (two.path / name).read_bytes()
    assert one.meta["splits"] == two.meta["splits"]


def test_validation_text_equal_to_the_training_text_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    copy = tmp_path / "copy.txt"
    copy.write_bytes(corpus.read_bytes())
    with raises_config_error(f"the validation text ({copy.resolve()}) is the same as the training text"):
        prepare(data_cfg(corpus, tmp_path / "cache", val_paths=(str(copy),)))
    first, second = write_corpus(tmp_path / "a.txt", DOCS[:60]), write_corpus(tmp_path / "b.txt", DOCS[60:])
    both = tmp_path / "both.txt"  # the two training files, one after the other, in one validation file
    both.write_bytes(first.read_bytes() + second.read_bytes())
    cfg = DataConfig(
        paths=(str(first), str(second)), val_paths=(str(both),), cache_dir=str(tmp_path / "cache")
    )
    with raises_config_error("is the same as the training text; pass other --val-data, or none"):
        prepare(cfg)


def test_validation_documents_that_occur_in_the_training_text_are_warned_about(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    tail = tmp_path / "tail.txt"  # the last part of the training file, cut inside document 99
    raw = corpus.read_bytes()
    tail.write_bytes(raw[raw.index(DOCS[99].encode()) + 10 :])
    picked = tmp_path / "picked.jsonl"  # some training documents, reordered, in another format
    picked.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[::-7]))
    for val, message in ((tail, "20 of 21 validation documents"), (picked, "18 of 18 validation documents")):
        with pytest.warns(
            store_mod.DataWarning, match=f"{message} \\(in {val.resolve()}\\) also occur in the"
        ):
            store = prepare(data_cfg(corpus, tmp_path / "cache", val_paths=(str(val),)))
        assert any("also occur in the training text" in w for w in store.meta["warnings"])
    held_out = write_corpus(tmp_path / "held_out.txt", [*DOCS[100:], DOCS[0]])  # one in 21 is no alarm
    with warnings.catch_warnings():
        warnings.simplefilter("error", store_mod.DataWarning)
        store = prepare(
            data_cfg(
                write_corpus(tmp_path / "train.txt", DOCS[:100]),
                tmp_path / "cache",
                val_paths=(str(held_out),),
            )
        )
    assert store.meta["warnings"] == []


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
        tmp_path / "val.txt", ["\n", "Thou art more lovely and more temperate, rough winds do shake"]
    )
    store = prepare(data_cfg(train, tmp_path / "cache", val_paths=(str(val),)))
    assert store.opening("val") == "Thou art more lovely and more"  # the first document with words
    assert store.opening("val", words=2) == "Thou art"
