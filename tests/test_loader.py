"""Loader: packing without padding, exact epoch coverage, determinism, resumable state, process shards,
evaluation batches, and memory that stays flat however large the corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import data_cfg, raises_config_error, write_corpus

from minigpt.config import ConfigError, DataConfig
from minigpt.data.build import prepare
from minigpt.data.loader import Windows, eval_batches, restore_position, train_iterator
from minigpt.data.store import TokenStore


def test_corpus_smaller_than_one_batch_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", ["one two three four five six"] * 3)
    store = prepare(data_cfg(corpus, tmp_path))
    with raises_config_error(
        f"the training text ({corpus}) makes 0 windows of 64 tokens, fewer than one global"
    ):
        train_iterator(store, 64, 8, seed=0)


def test_packing_has_no_pad_and_covers_each_target_exactly_once_per_epoch(
    small_corpus: Path, cache_dir: str
) -> None:
    seq_len = 16
    store = prepare(data_cfg(small_corpus, cache_dir, seq_len=seq_len))
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


def test_windows_are_the_stream_cut_with_stride_seq_len(tmp_path: Path) -> None:
    tokens = np.arange(50, dtype=np.uint16)
    w = Windows(tokens, 8)
    assert len(w) == 6
    assert w[0].tolist() == list(range(9))
    assert w[5].tolist() == list(range(40, 49))
    targets = np.concatenate([w[i][1:] for i in range(len(w))])
    assert targets.tolist() == list(range(1, 49))  # every token but the first and the tail is a target once
    tokens.tofile(tmp_path / "t.bin")
    mapped = Windows(np.memmap(tmp_path / "t.bin", np.uint16, mode="r"), 8)  # read with pread
    assert mapped._fd is not None
    assert all(np.array_equal(mapped[i], w[i]) and mapped[i].dtype == np.int32 for i in range(len(w)))
    with pytest.raises(IndexError):
        mapped[6]


def test_same_seed_same_batches_different_seed_different(small_corpus: Path, cache_dir: str) -> None:
    store = prepare(data_cfg(small_corpus, cache_dir))
    a = [next(it) for it in [train_iterator(store, 16, 4, seed=1)] for _ in range(5)]
    b = [next(it) for it in [train_iterator(store, 16, 4, seed=1)] for _ in range(5)]
    c = [next(it) for it in [train_iterator(store, 16, 4, seed=2)] for _ in range(5)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iterator_state_resumes_the_identical_batch_sequence(small_corpus: Path, cache_dir: str) -> None:
    store = prepare(data_cfg(small_corpus, cache_dir))
    it = train_iterator(store, 16, 4, seed=0)
    for _ in range(7):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(30)]  # runs past the end of an epoch
    resumed = train_iterator(store, 16, 4, seed=0)
    resumed.set_state(state)
    assert all(np.array_equal(x, next(resumed)) for x in expected)


def test_restore_position_resumes_the_identical_batch_sequence(tmp_path: Path) -> None:
    store = _arange_store(tmp_path, 16 * 64 + 1)
    it = train_iterator(store, 16, 4, seed=0)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as the checkpoint stores it
    expected = [next(it) for _ in range(20)]  # past the end of an epoch
    resumed = train_iterator(store, 16, 4, seed=0)
    restore_position(resumed, state)
    assert all(np.array_equal(x, next(resumed)) for x in expected)


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({}, "(no 'next_index')"),
        ({"position": 7}, "(no 'next_index', unknown 'position')"),
        ({"next_index": 3, "epoch": 1}, "(unknown 'epoch')"),
        ({"next_index": "3"}, "(TypeError: '<' not supported between instances of 'str' and 'int')"),
        ({"next_index": -5}, "(IndexError: Checkpoint `next_index` -5 is out of range"),
        (None, "(it is a NoneType, not a dict)"),
    ],
)
def test_a_data_position_from_another_version_is_one_line(tmp_path: Path, state: object, why: str) -> None:
    """A checkpoint's data position this pipeline cannot take (written by another minigpt or Grain version):
    `set_state` would fail deep in Grain (KeyError: 'next_index'); `restore_position` says what to do."""
    it = train_iterator(_arange_store(tmp_path, 16 * 64 + 1), 16, 4, seed=0)
    with pytest.raises(ConfigError) as e:
        restore_position(it, state)
    message = str(e.value)
    assert message.startswith(f"the checkpoint's data position {state!r} cannot be restored {why}"), message
    assert message.endswith(
        "it was written by another version of minigpt's data pipeline; resume with that version, or start "
        "again with --overwrite"
    )
    assert "\n" not in message


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
    store = prepare(data_cfg(small_corpus, cache_dir))
    n = len(Windows(store.tokens("val"), 8))
    batches = list(eval_batches(store, 8, 3))
    weights = np.concatenate([w for _, w in batches])
    assert weights.sum() == n and len(weights) == 3 * len(batches)
    assert all(t.shape == (3, 9) for t, _ in batches)
    rows = np.concatenate([t for t, _ in batches])[weights > 0]
    assert np.array_equal(rows[:, :-1].ravel(), np.asarray(store.tokens("val"))[: n * 8])  # in order


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


def _loader_rss_growth_mb(store: TokenStore, batches: int) -> float:
    it = train_iterator(store, 128, 32, seed=0)  # the cpu preset's batch
    for _ in range(5):
        next(it)
    before = _status_mb("VmRSS")
    for _ in range(batches):
        next(it)
    return _status_mb("VmRSS") - before


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_the_token_file_is_not_loaded_into_memory(tmp_path: Path) -> None:
    # 60M tokens = 120 MB. Random windows read through the memory map would leave most of it resident
    # (page faults map whole neighbourhoods); the loader's positional reads leave none of it.
    pattern = np.arange(1 << 16, dtype=np.uint16).tobytes()
    with open(tmp_path / "train.bin", "wb") as f:
        for _ in range(60_000_000 >> 16):
            f.write(pattern)
    size_mb = (tmp_path / "train.bin").stat().st_size / 2**20
    growth = _loader_rss_growth_mb(TokenStore(tmp_path, {"dtype": "uint16"}), 300)
    assert growth < size_mb / 10, (
        f"resident memory grew {growth:.0f} MB over 300 batches of a {size_mb:.0f} MB file"
    )


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads peak memory from /proc")
def test_a_corpus_over_100mb_is_tokenized_and_loaded_with_flat_memory(
    tmp_path: Path, tinystories: Path, gpt2_dir: Path
) -> None:
    text = (tinystories / "train.txt").read_bytes()
    corpus = tmp_path / "big.txt"
    with open(corpus, "wb") as f:
        for _ in range(-(-105_000_000 // len(text))):
            f.write(text)
    text_mb = corpus.stat().st_size / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter to the current RSS
    before = _status_mb("VmRSS")
    store = prepare(
        DataConfig(paths=(str(corpus),), tokenizer="gpt2", gpt2_dir=str(gpt2_dir), cache_dir=str(tmp_path))
    )
    peak = _status_mb("VmHWM") - before
    assert peak < text_mb / 2, f"prepare's peak memory grew {peak:.0f} MB for {text_mb:.0f} MB of text"
    tokens_mb = (store.path / "train.bin").stat().st_size / 2**20
    assert tokens_mb > 40
    growth = _loader_rss_growth_mb(store, 300)
    assert growth < tokens_mb / 10, (
        f"loading grew resident memory {growth:.0f} MB ({tokens_mb:.0f} MB of tokens)"
    )


# ---- mixtures of sources, windows that begin at documents ----


def _offset_store(path: Path, n_tokens: int, offset: int, doc_starts: list[int] | None = None) -> TokenStore:
    """A store whose tokens are offset..offset+n-1, so a window names its source and its position."""
    path.mkdir(parents=True, exist_ok=True)
    (np.arange(n_tokens, dtype=np.uint16) + offset).tofile(path / "train.bin")
    np.save(path / "train.docs.npy", np.asarray(doc_starts or [0], np.int64))
    return TokenStore(path, {"dtype": "uint16"})


def test_a_mixture_draws_windows_from_its_sources_at_their_weights(tmp_path: Path) -> None:
    big = _offset_store(tmp_path / "big", 16 * 2000 + 1, 0)
    small = _offset_store(tmp_path / "small", 16 * 50 + 1, 40_000)  # repeats ~40 times in 10,000 windows
    it = train_iterator([big, small], 16, 100, seed=0, weights=[0.7, 0.3])
    firsts = np.concatenate([next(it)[:, 0] for _ in range(100)])  # 10,000 windows
    share = float(np.mean(firsts >= 40_000))
    assert abs(share - 0.3) < 0.01, share
    small_starts = firsts[firsts >= 40_000] - 40_000
    # the small source repeats by epochs: each of its 50 windows about equally often
    counts = np.bincount(small_starts // 16, minlength=50)
    assert counts.min() >= 55 and counts.max() <= 65, counts


def test_a_mixture_resumes_exactly_in_the_middle(tmp_path: Path) -> None:
    stores = [
        _offset_store(tmp_path / "a", 16 * 300 + 1, 0),
        _offset_store(tmp_path / "b", 16 * 20 + 1, 9000),
    ]
    it = train_iterator(stores, 16, 8, seed=4, weights=[0.5, 0.5])
    for _ in range(7):  # past the small source's first epoch (20 windows)
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(6)]
    resumed = train_iterator(stores, 16, 8, seed=4, weights=[0.5, 0.5])
    restore_position(resumed, json.loads(json.dumps(state)))  # as a checkpoint stores it
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)


def test_document_windows_begin_at_each_documents_end_of_text(tmp_path: Path) -> None:
    # documents start at 0, 5, 30 and 33 of a 40-token split; the second is 25 tokens long
    store = _offset_store(tmp_path / "d", 40, 0, [0, 5, 30, 33])
    it = train_iterator(store, 8, 1, seed=0, window_start="document")
    starts = sorted(int(next(it)[0, 0]) for _ in range(7))
    # each at the end-of-text before its document (start - 1), the long one going on every 8 tokens; the
    # last document's window is moved back to fit in the split
    assert starts == [0, 4, 12, 20, 28, 29, 31]
    assert sorted(int(next(it)[0, 0]) for _ in range(7)) == starts  # 7 windows an epoch


def test_window_start_is_checked() -> None:
    with raises_config_error("window_start"):
        DataConfig(window_start="middle")  # type: ignore[arg-type]


def test_a_run_resumed_after_its_store_was_extended_reads_the_same_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run records the extent it reads (`Corpus.extent`); resumed on that extent after another run extended
    the store, it draws the batches an uninterrupted run draws, for training and evaluation alike."""
    from conftest import DOCS

    import minigpt.data.build as build_mod
    import minigpt.data.corpus as corpus_mod
    from minigpt.data.mixture import prepare_corpus

    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(build_mod, "PREFIX_MIN_TOKENS", 0)
    cfg = data_cfg(write_corpus(tmp_path / "c.txt", DOCS * 8), tmp_path / "cache")
    corpus = prepare_corpus(cfg, train_tokens=2000)
    extent = corpus.extent()  # what the run records in data.json
    assert not corpus.first.complete and extent[""]["train"] >= 2000

    def batches(store: TokenStore, state: dict | None, n: int) -> tuple[list[np.ndarray], dict]:
        it = train_iterator(store, 16, 4, seed=0, window_start="document")
        if state is not None:
            restore_position(it, state)
        out = [next(it) for _ in range(n)]
        return out, it.get_state()

    _, state = batches(corpus.first, None, 5)
    uninterrupted, _ = batches(corpus.first, state, 40)  # past an epoch of the extent's windows
    val = list(eval_batches(corpus.first, 16, 4))
    extended = prepare_corpus(cfg, train_tokens=8000)
    assert extended.first.size("train") > extent[""]["train"]
    resumed = prepare_corpus(cfg, extent=extent)  # the resumed run: no work, the recorded extent
    assert resumed.extent() == extent and resumed.identity == corpus.identity
    again, _ = batches(resumed.first, state, 40)
    assert all(np.array_equal(a, b) for a, b in zip(uninterrupted, again, strict=True))
    assert all(
        np.array_equal(a[0], b[0]) for a, b in zip(val, eval_batches(resumed.first, 16, 4), strict=True)
    )
    whole, _ = batches(extended.first, state, 40)  # without its extent the run would read other windows
    assert not all(np.array_equal(a, b) for a, b in zip(uninterrupted, whole, strict=True))


def _copy_tokens_over(path: Path, src: int, dst: int, n: int) -> None:
    """Valid tokens copied over another place of a token file: same size, every token a real one."""
    data = bytearray(path.read_bytes())
    data[dst : dst + n] = data[src : src + n]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("chunk", [1 << 12, 1 << 20])
def test_a_token_file_changed_after_its_build_is_caught_as_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Tokens copied over others in train.bin or val.bin (the size unchanged, so only a content check finds
    it): the loader and the evaluation refuse in one line naming the file and `minigpt prepare`, as soon as
    they read the changed chunk; an intact store reads as before."""
    import minigpt.data.build as build_mod

    monkeypatch.setattr(build_mod, "CHUNK_BYTES", chunk)
    corpus = write_corpus(
        tmp_path / "c.txt", [f"Story {i}: Tom and Mia went out to play by the sea." for i in range(3000)]
    )
    val = write_corpus(tmp_path / "v.txt", [f"Val {i}: Sam saw a red ball." for i in range(400)])
    store = prepare(data_cfg(corpus, tmp_path / "cache", val_paths=(str(val),)))
    assert store.meta["splits"]["train"]["chunks"]["bytes"] == chunk
    epoch = len(Windows(store.tokens("train"), 16)) // 8
    intact = [next(it) for it in [train_iterator(store, 16, 8, seed=0)] for _ in range(epoch)]
    assert len(intact) == epoch and len(list(eval_batches(store, 16, 8)))
    size = (store.path / "train.bin").stat().st_size
    _copy_tokens_over(store.path / "train.bin", 0, size // 2, 64)
    _copy_tokens_over(store.path / "val.bin", 0, 200, 64)
    it = train_iterator(store, 16, 8, seed=0)
    with raises_config_error(f"token store {store.path}: train.bin bytes "):
        for _ in range(epoch):  # one epoch reads every window, the changed ones among them
            next(it)
    with pytest.raises(ConfigError, match=r"val.bin bytes .* differ from the digest .* `minigpt prepare`"):
        list(eval_batches(store, 16, 8))
