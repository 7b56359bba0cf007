"""Token store and loader: sources, streaming, caching, bad input, packing without padding, exact epoch coverage,
determinism, resumable state, and memory that stays flat however large the corpus."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_corpus

import minigpt.data as data_mod
from minigpt.config import ConfigError, DataConfig
from minigpt.data import (
    DataWarning,
    TokenStore,
    Windows,
    eval_batches,
    prepare,
    read_documents,
    resolve_files,
    train_iterator,
)
from minigpt.tokenizer import EOT, BPETokenizer

DOCS = [
    f"Doc {i}: {['Tom', 'Mia', 'Sam', 'Lily'][i % 4]} saw {['a cat', 'the sea', 'a big tree'][i % 3]}.\n"
    f"They played {'all day ' * (i % 5)}and it was caf\u00e9 time {i * 7}. \u2014 \U0001f431"
    for i in range(120)
]
FLAT_DOCS = [d.replace("\n", " ") for d in DOCS]  # for blank-line separated files


def _cfg(corpus: Path | str, cache_dir: Path | str, **kw) -> DataConfig:
    kw.setdefault("tokenizer", "bpe")
    kw.setdefault("bpe_vocab_size", 300)
    return DataConfig(paths=(str(corpus),), cache_dir=str(cache_dir), **kw)


def _raises(message: str):
    return pytest.raises(ConfigError, match=re.escape(message))


def _stored_docs(store: TokenStore, split: str) -> list[str]:
    """Decode a split back into documents, checking that one end-of-text token closes each."""
    tok = store.tokenizer()
    tokens, starts = np.asarray(store.tokens(split)), np.asarray(store.doc_starts(split))
    docs = []
    for s, e in zip(starts, [*starts[1:], len(tokens)], strict=True):
        assert tokens[e - 1] == tok.eot_id and tok.eot_id not in tokens[s : e - 1]
        docs.append(tok.decode(tokens[s : e - 1]))
    assert len(tokens) == store.meta["splits"][split]["tokens"]
    assert len(docs) == store.meta["splits"][split]["documents"]
    return docs


def _write_blank(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n")
    return path


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def _write_parquet(path: Path, docs: list, field: str = "text") -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=50)
    return path


FORMATS = {  # name: (write the corpus in tmp_path, separator, documents)
    "txt": (lambda p, d: write_corpus(p / "c.txt", d), "eot", DOCS),
    "blank-line": (lambda p, d: _write_blank(p / "c.txt", d), "blank-line", FLAT_DOCS),
    "jsonl": (lambda p, d: _write_jsonl(p / "c.jsonl", d), "eot", DOCS),
    "parquet": (lambda p, d: _write_parquet(p / "c.parquet", d), "eot", DOCS),
}


# ------------------------------------------------------------------------------------------------ sources


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_stores_every_document_once_and_an_epoch_trains_every_token_once(
    tmp_path: Path, fmt: str
) -> None:
    write, separator, docs = FORMATS[fmt]
    store = prepare(_cfg(write(tmp_path, docs), tmp_path / "cache", separator=separator))
    assert sorted(_stored_docs(store, "train") + _stored_docs(store, "val")) == sorted(docs)
    assert store.meta["splits"]["val"]["documents"] >= 1
    # One epoch, gathered from 3 hosts' shards, holds every stride-16 window of the token stream exactly once:
    # each token (but the first and the tail shorter than a window) is a training target exactly once.
    seq_len, hosts = 16, 3
    windows = Windows(store.tokens("train"), seq_len)
    epoch = []
    for p in range(hosts):
        it = train_iterator(store, seq_len, 1, seed=3, process_index=p, process_count=hosts)
        epoch += [tuple(next(it)[0]) for _ in range(p, len(windows), hosts)]
    assert sorted(epoch) == sorted(tuple(windows[i]) for i in range(len(windows)))
    assert len(windows) * seq_len >= store.meta["splits"]["train"]["tokens"] - seq_len


def test_folders_and_globs_expand_to_sorted_source_files(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    b = write_corpus(tmp_path / "b.txt", DOCS[:3]).resolve()
    a = _write_jsonl(tmp_path / "sub" / "a.jsonl", DOCS[3:6]).resolve()
    (tmp_path / "notes.md").write_text("not a source in a folder")
    write_corpus(tmp_path / ".git" / "x.txt", ["hidden"])
    assert resolve_files([str(tmp_path)]) == [b, a]
    assert resolve_files([str(tmp_path / "**" / "*.jsonl")]) == [a]
    assert resolve_files([str(b), str(tmp_path / "*.txt")]) == [b]  # a file given twice is read once
    assert resolve_files([str(tmp_path / "notes.md")]) == [(tmp_path / "notes.md").resolve()]


def test_mixed_folder_is_read_in_sorted_order_and_validation_files_are_used_whole(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    write_corpus(tmp_path / "src" / "b.txt", DOCS[:40])
    _write_jsonl(tmp_path / "src" / "a.jsonl", DOCS[40:80])
    val = write_corpus(tmp_path / "val.txt", DOCS[80:])
    store = prepare(_cfg(tmp_path / "src", tmp_path / "cache", val_paths=(str(val),)))
    assert _stored_docs(store, "train") == DOCS[40:80] + DOCS[:40]
    assert _stored_docs(store, "val") == DOCS[80:]


def test_jsonl_and_parquet_read_the_configured_text_field(tmp_path: Path) -> None:
    jsonl = _write_jsonl(tmp_path / "c.jsonl", DOCS[:10], field="body")
    parquet = _write_parquet(tmp_path / "c.parquet", [*DOCS[:10], None, "  "], field="body")
    cfg = DataConfig(text_field="body")
    assert (
        read_documents(jsonl, cfg) == DOCS[:10] == read_documents(parquet, cfg)
    )  # null and blank rows skipped


def test_blank_line_separator_splits_paragraphs_and_strips_them(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text(
        "\ufeff  First para\nstill first.\r\n\r\nSecond.\n \t\n\n\nThird <|endoftext|> inline.\n\n"
    )
    assert read_documents(path, DataConfig(separator="blank-line")) == [
        "First para\nstill first.",
        "Second.",
        "Third <|endoftext|> inline.",
    ]
    assert read_documents(path) == ["First para\nstill first.\r\n\r\nSecond.\n \t\n\n\nThird", "inline."]


@pytest.mark.parametrize("fmt", ["txt", "blank-line"])
def test_read_block_boundaries_do_not_change_the_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    write, separator, docs = FORMATS[fmt]
    path, cfg = write(tmp_path, docs[:30]), DataConfig(separator=separator)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # a byte-order mark is not text
    assert read_documents(path, cfg) == docs[:30]
    for block in (1, 7, 13, 64):  # separators and multi-byte characters cut at every possible place
        monkeypatch.setattr(data_mod, "BLOCK_BYTES", block)
        assert read_documents(path, cfg) == docs[:30]


def test_long_documents_are_tokenized_in_pieces_exactly_and_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tinystories: Path, gpt2_dir: Path
) -> None:
    story = (tinystories / "valid.txt").read_text()[:12000].replace(EOT, "").strip()
    docs = ["short one", story, "short two", story[:3000].strip()]
    corpus = write_corpus(tmp_path / "c.txt", docs)
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", 1000)  # the long document spans many reads...
    monkeypatch.setattr(data_mod, "PIECE_CHARS", 400)  # ...and reaches the tokenizer in pieces
    monkeypatch.setattr(data_mod, "LONG_DOC_BYTES", 10000)
    for tokenizer in ("gpt2", "bpe"):
        cfg = _cfg(corpus, tmp_path / "cache", tokenizer=tokenizer, gpt2_dir=str(gpt2_dir))
        with pytest.warns(DataWarning, match=re.escape(f"{corpus.resolve()}: 1 documents longer than")):
            store = prepare(cfg)
        tok = store.tokenizer()
        stored = []
        for split in ("train", "val"):
            tokens, starts = np.asarray(store.tokens(split)), np.asarray(store.doc_starts(split))
            for s, e in zip(starts, [*starts[1:], len(tokens)], strict=True):
                stored.append(tok.decode(tokens[s : e - 1]))
                assert tokens[s : e - 1].tolist() == tok.encode(stored[-1])  # pieces tokenize like the whole
        assert sorted(stored) == sorted(docs)


# -------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "training corpus is empty"),
        (b"\n<|endoftext|>\n  \n<|endoftext|>\n", "training corpus is empty"),
        (b"just one document", "need at least 2 documents to hold some out for validation"),
        (b"hello\x00world", "bad.txt is not a text file (NUL byte at offset 5)"),
        (b"x" * 5000 + b"\x00", "bad.txt is not a text file (NUL byte at offset 5000)"),  # in a later block
        ("caf\u00e9 ok".encode() + b"\xff\xfe bad", "bad.txt is not valid UTF-8 (bad byte at offset 8)"),
        (
            b"a\n<|endoftext|>\n" * 300 + b"\xc3(",
            "not valid UTF-8 (bad byte at offset 4800); pass --data.encoding-errors replace",
        ),
    ],
)
def test_bad_corpora_are_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes, message: str
) -> None:
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", 1024)
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with _raises(message):
        prepare(_cfg(path, tmp_path / "cache"))
    assert not list((tmp_path / "cache" / "tokens").glob("*.tmp"))  # nothing half-built is left behind


def test_undecodable_bytes_can_be_replaced_with_a_warning_that_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes(
        b"caf\xe9 and na\xefve\n<|endoftext|>\nreal \xef\xbf\xbd stays\n<|endoftext|>\nbad \xff end"
    )
    cfg = DataConfig(encoding_errors="replace")
    with pytest.warns(
        DataWarning, match=re.escape(f"{path.resolve()}: replaced 3 undecodable byte sequences")
    ):
        prepare(_cfg(path, tmp_path / "cache", encoding_errors="replace", val_fraction=0.5))
    assert read_documents(path, cfg) == ["caf\ufffd and na\ufffdve", "real \ufffd stays", "bad \ufffd end"]


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        (["nope.txt"], "data path not found: "),
        (["*.nothing"], "no files match "),
        (["empty_dir"], "holds no .txt, .jsonl, .parquet files"),
    ],
)
def test_missing_paths_are_refused(tmp_path: Path, paths: list[str], message: str) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "readme.md").write_text("no sources here")
    cfg = DataConfig(paths=tuple(str(tmp_path / p) for p in paths), cache_dir=str(tmp_path))
    with _raises(message):
        prepare(cfg)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"text": "ok"}\n{"text": "unterminated\n', "c.jsonl:2 is not valid JSON ("),
        ('{"text": "ok"}\n["a list"]\n', "c.jsonl:2 must be a JSON object, got list"),
        ('{"text": "ok"}\n{"body": "x", "id": 1}\n', 'c.jsonl:2 has no "text" field (it has: body, id)'),
        ('{"text": 42}\n', 'c.jsonl:1: "text" must be a string, got int'),
        ('{"text": "a\\ud800b"}\n', "c.jsonl:1 holds a lone UTF-16 surrogate escape"),
    ],
)
def test_bad_jsonl_is_refused_naming_the_line(tmp_path: Path, lines: str, message: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(lines)
    with _raises(message):
        prepare(_cfg(path, tmp_path / "cache"))


def test_bad_parquet_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "c.parquet", DOCS[:5], field="body")
    with _raises('c.parquet has no "text" column (it has: id, body); choose one with --data.text-field'):
        prepare(_cfg(path, tmp_path / "cache"))
    with _raises('c.parquet: column "id" holds int64, not strings'):
        prepare(_cfg(path, tmp_path / "cache", text_field="id"))
    (tmp_path / "fake.parquet").write_text("PAR1 but not really")
    with _raises("fake.parquet is not a readable Parquet file"):
        prepare(_cfg(tmp_path / "fake.parquet", tmp_path / "cache"))


def test_a_file_in_both_training_and_validation_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS[:5])
    with _raises("c.txt is both training and validation data"):
        prepare(_cfg(tmp_path, tmp_path / "cache", val_paths=(str(corpus),)))


def test_a_store_from_another_tokenizer_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    cfg = _cfg(corpus, tmp_path / "cache")
    store = prepare(cfg)
    meta = json.loads((store.path / "meta.json").read_text())
    meta["tokenizer"]["request"], meta["tokenizer"]["identity"] = "gpt2", "gpt2"
    (store.path / "meta.json").write_text(json.dumps(meta))
    with _raises(f"token store {store.path} holds tokens of tokenizer gpt2, but the config asks for bpe300"):
        prepare(cfg)
    meta["tokenizer"]["request"] = "bpe300"
    (store.path / "meta.json").write_text(json.dumps(meta))
    BPETokenizer.train(["other text entirely"] * 20, 280).save(store.path / "tokenizer")
    with _raises("tokenizer/ is not the tokenizer its tokens were made with"):
        prepare(cfg)


def test_corpus_smaller_than_one_batch_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", ["one two three four five six"] * 3)
    store = prepare(_cfg(corpus, tmp_path))
    with _raises("fewer than one global batch"):
        train_iterator(store, 64, 8, seed=0)


# ---------------------------------------------------------------------------------------------- caching


def test_prepare_is_cached_and_rebuilt_when_half_written(small_corpus: Path, tmp_path: Path) -> None:
    cfg = _cfg(small_corpus, tmp_path)
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
    cfg = _cfg(corpus, tmp_path / "cache")
    first = prepare(cfg)
    build = data_mod._build

    def must_not_build(*a, **kw):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_mod, "_build", must_not_build)
    assert prepare(cfg).meta == first.meta  # the fast path: same path, size and mtime
    later = time.time() + 100
    os.utime(corpus, (later, later))  # touched, not changed: the sha256 says so
    assert prepare(cfg).meta["sources"]["train"][0]["mtime_ns"] == corpus.stat().st_mtime_ns
    write_corpus(corpus, [*DOCS, "one more document"])
    monkeypatch.setattr(data_mod, "_build", build)
    changed = prepare(cfg)
    assert changed.path == first.path
    assert sorted(_stored_docs(changed, "train") + _stored_docs(changed, "val")) == sorted(
        [*DOCS, "one more document"]
    )


def test_meta_records_sources_tokenizer_and_counts(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    store = prepare(_cfg(corpus, tmp_path / "cache"))
    (src,) = store.meta["sources"]["train"]
    assert src["path"] == str(corpus.resolve()) and src["size"] == corpus.stat().st_size
    assert src["sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest() and src["documents"] == len(DOCS)
    tok = store.tokenizer()
    assert store.meta["tokenizer"]["identity"] == tok.identity == store.meta["tokenizer_identity"]
    assert (
        store.meta["tokenizer"]["vocab_hash"] == tok.vocab_hash
        and store.meta["tokenizer"]["request"] == "bpe300"
    )
    text_bytes = sum(len(d.encode()) for s in ("train", "val") for d in _stored_docs(store, s))
    assert (
        store.meta["splits"]["train"]["text_bytes"] + store.meta["splits"]["val"]["text_bytes"] == text_bytes
    )


def test_a_different_tokenizer_gets_its_own_store(small_corpus: Path, cache_dir: str, gpt2_dir: Path) -> None:
    bpe = prepare(_cfg(small_corpus, cache_dir))
    gpt2 = prepare(
        DataConfig(paths=(str(small_corpus),), tokenizer="gpt2", gpt2_dir=str(gpt2_dir), cache_dir=cache_dir)
    )
    assert bpe.path != gpt2.path
    assert gpt2.meta["tokenizer_identity"] == "gpt2" and gpt2.vocab_size == 50257


def test_bpe_trains_on_a_bounded_prefix_of_the_training_documents(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS[:100])
    val = write_corpus(tmp_path / "v.txt", DOCS[100:])
    budget = 2000
    store = prepare(_cfg(corpus, tmp_path / "cache", val_paths=(str(val),), bpe_train_bytes=budget))
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
    monkeypatch.setattr(data_mod, "CHUNK_CHARS", 2000)  # many chunks in flight, completing out of order
    one = prepare(_cfg(corpus, tmp_path / "a", tokenize_workers=1))
    two = prepare(_cfg(corpus, tmp_path / "b", tokenize_workers=2))
    assert two.meta["build"]["workers"] == 2
    for name in ("train.bin", "val.bin", "train.docs.npy", "val.docs.npy"):
        assert (one.path / name).read_bytes() == (two.path / name).read_bytes()
    assert one.meta["splits"] == two.meta["splits"]


# ----------------------------------------------------------------------------------------------- loader


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
