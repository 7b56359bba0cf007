"""Token store and loader: packing without padding, exact epoch coverage, determinism, resumable state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import write_corpus

from minigpt.config import ConfigError, DataConfig
from minigpt.data import TokenStore, Windows, eval_batches, prepare, read_documents, train_iterator


def _cfg(corpus: Path, cache_dir: str, **kw) -> DataConfig:
    return DataConfig(paths=(str(corpus),), tokenizer="bpe", bpe_vocab_size=300, cache_dir=cache_dir, **kw)


def test_store_holds_every_document_once_with_eot_after_each(small_corpus: Path, cache_dir: str) -> None:
    store = prepare(_cfg(small_corpus, cache_dir, seq_len=16))
    tok = store.tokenizer()
    docs = read_documents(small_corpus)
    stored = []
    for split in ("train", "val"):
        tokens, starts = np.asarray(store.tokens(split)), store.doc_starts(split)
        ends = [*starts[1:], len(tokens)]
        for s, e in zip(starts, ends, strict=True):
            assert tokens[e - 1] == tok.eot_id
            stored.append(tok.decode(tokens[s : e - 1]))
    assert sorted(stored) == sorted(docs)
    assert store.meta["splits"]["val"]["documents"] >= 1
    assert store.dtype == np.uint16


def test_packing_has_no_pad_and_covers_each_target_exactly_once_per_epoch(
    small_corpus: Path, cache_dir: str
) -> None:
    seq_len = 16
    store = prepare(_cfg(small_corpus, cache_dir, seq_len=seq_len))
    windows = Windows(store.tokens("train"), seq_len)
    n = len(windows)
    it = train_iterator(store, seq_len, 1, seed=3)
    epoch = sorted(tuple(next(it)[0]) for _ in range(n))
    # One epoch yields exactly the stride-seq_len windows of the token stream, each once: no pad rows,
    # no window dropped or repeated. Their targets tile the stream (see the next test).
    assert epoch == sorted(tuple(windows[i]) for i in range(n))
    second = sorted(tuple(next(it)[0]) for _ in range(n))
    assert second == epoch
    assert n * seq_len >= len(windows.tokens) - seq_len  # only the tail shorter than one window is left out


def test_windows_are_the_stream_cut_with_stride_seq_len() -> None:
    tokens = np.arange(50, dtype=np.uint16)
    w = Windows(tokens, 8)
    assert len(w) == 6
    assert w[0].tolist() == list(range(9))
    assert w[5].tolist() == list(range(40, 49))
    targets = np.concatenate([w[i][1:] for i in range(len(w))])
    assert targets.tolist() == list(range(1, 49))  # every token but the first and the tail is a target once


def test_same_seed_same_batches_different_seed_different(small_corpus: Path, cache_dir: str) -> None:
    store = prepare(_cfg(small_corpus, cache_dir))
    a = [next(it) for it in [train_iterator(store, 16, 4, seed=1)] for _ in range(5)]
    b = [next(it) for it in [train_iterator(store, 16, 4, seed=1)] for _ in range(5)]
    c = [next(it) for it in [train_iterator(store, 16, 4, seed=2)] for _ in range(5)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iterator_state_resumes_the_identical_batch_sequence(small_corpus: Path, cache_dir: str) -> None:
    store = prepare(_cfg(small_corpus, cache_dir))
    it = train_iterator(store, 16, 4, seed=0)
    for _ in range(7):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(30)]  # runs past the end of an epoch
    resumed = train_iterator(store, 16, 4, seed=0)
    resumed.set_state(state)
    assert all(np.array_equal(x, next(resumed)) for x in expected)


def _arange_store(tmp_path: Path, n_tokens: int) -> TokenStore:
    """A store whose tokens are 0..n-1, so every window is unique and identifies its own position."""
    np.arange(n_tokens, dtype=np.uint16).tofile(tmp_path / "train.bin")
    return TokenStore(tmp_path, {"dtype": "uint16"})


@pytest.mark.parametrize("n_processes", [2, 4])
def test_process_shards_are_disjoint_and_cover_the_epoch(tmp_path: Path, n_processes: int) -> None:
    store = _arange_store(tmp_path, 16 * 64 + 1)
    per_process = 64 // n_processes // 2  # batches of 2 windows
    starts = []
    for p in range(n_processes):
        it = train_iterator(store, 16, 2, seed=5, process_index=p, process_count=n_processes)
        starts += [int(row[0]) for _ in range(per_process) for row in next(it)]
    assert sorted(starts) == list(range(0, 16 * 64, 16))


def test_eval_batches_walk_the_whole_split_once_with_zero_weight_padding(
    small_corpus: Path, cache_dir: str
) -> None:
    store = prepare(_cfg(small_corpus, cache_dir))
    n = len(Windows(store.tokens("val"), 8))
    batches = list(eval_batches(store, 8, 3))
    weights = np.concatenate([w for _, w in batches])
    assert weights.sum() == n and len(weights) == 3 * len(batches)
    assert all(t.shape == (3, 9) for t, _ in batches)


def test_prepare_is_cached_and_rebuilt_when_half_written(small_corpus: Path, tmp_path: Path) -> None:
    cfg = _cfg(small_corpus, str(tmp_path))
    first = prepare(cfg)
    assert prepare(cfg).path == first.path
    (first.path / "meta.json").unlink()  # as if the process died before finishing
    (first.path / "train.bin").write_bytes(b"garbage")
    again = prepare(cfg)
    assert again.meta["complete"] and len(again.tokens("train")) == first.meta["splits"]["train"]["tokens"]


def test_a_different_tokenizer_gets_its_own_store(small_corpus: Path, cache_dir: str, gpt2_dir: Path) -> None:
    bpe = prepare(_cfg(small_corpus, cache_dir))
    gpt2 = prepare(
        DataConfig(paths=(str(small_corpus),), tokenizer="gpt2", gpt2_dir=str(gpt2_dir), cache_dir=cache_dir)
    )
    assert bpe.path != gpt2.path
    assert gpt2.meta["tokenizer_identity"] == "gpt2" and gpt2.vocab_size == 50257


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "training corpus is empty"),
        (b"\n<|endoftext|>\n  \n<|endoftext|>\n", "training corpus is empty"),
        (b"hello\x00world", "not a text file (NUL byte at offset 5)"),
        ("caf\u00e9 ok".encode() + b"\xff\xfe bad", "not valid UTF-8 (bad byte at offset 8)"),
    ],
)
def test_bad_corpora_are_refused_with_the_reason(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare(_cfg(path, str(tmp_path / "cache")))


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data path not found"):
        prepare(_cfg(tmp_path / "nope.txt", str(tmp_path)))


def test_corpus_smaller_than_one_batch_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", ["one two three four five six"] * 3)
    store = prepare(_cfg(corpus, str(tmp_path)))
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        train_iterator(store, 64, 8, seed=0)
