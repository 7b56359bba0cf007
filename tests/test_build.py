"""Building a token store: what prepare refuses, caching and rebuilding, the meta it records, BPE training on a
bounded prefix, and interrupted builds continuing from their journal."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import DOCS, data_cfg, raises_config_error, stored_docs, subprocess_env, write_corpus

import minigpt.data.build as build_mod
import minigpt.data.corpus as corpus_mod
import minigpt.data.encode as encode_mod
import minigpt.data.progress as progress_mod
from minigpt.config import ConfigError, DataConfig
from minigpt.data.build import prepare
from minigpt.data.progress import megabytes
from minigpt.data.store import TokenStore
from minigpt.data.tokenizer import BPETokenizer
from minigpt.runtime.errors import DataWarning

# -------------------------------------------------------------------------------------------------- bad input


def test_a_file_in_both_training_and_validation_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS[:5])
    with raises_config_error("c.txt is both training and validation data"):
        prepare(data_cfg(tmp_path, tmp_path / "cache", val_paths=(str(corpus),)))


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
    build = build_mod._build

    def must_not_build(*a, **kw):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(build_mod, "_build", must_not_build)
    assert prepare(cfg).meta == first.meta  # the fast path: same path, size and mtime
    later = time.time() + 100
    os.utime(corpus, (later, later))  # touched, not changed: the sha256 says so
    assert prepare(cfg).meta["sources"]["train"][0]["mtime_ns"] == corpus.stat().st_mtime_ns
    write_corpus(corpus, [*DOCS, "one more document"])
    monkeypatch.setattr(build_mod, "_build", build)
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
        seen += len(d.encode())
        if seen >= budget:
            break
    assert len(sample) < 100
    assert store.meta["tokenizer"]["identity"] == BPETokenizer.train(sample, 300).identity


# ------------------------------------------------------------------------------------------ interrupted builds


def _assert_same_store(a: TokenStore, b: TokenStore) -> None:
    """The same files, byte for byte (no journal left), and the same meta but for how the build went."""
    names = sorted(p.relative_to(a.path) for p in a.path.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b.path) for p in b.path.rglob("*") if p.is_file())
    assert "journal.json" not in map(str, names)
    for name in names:
        if str(name) != "meta.json":
            assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name
    assert {**a.meta, "build": None} == {**b.meta, "build": None}


def _journal(cache: Path) -> dict:
    (path,) = (cache / "tokens").glob("*.tmp/journal.json")
    return json.loads(path.read_text())


def _count_tokenized(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Characters tokenized in this process from now on (one element per chunk)."""
    counts: list[int] = []
    encode = encode_mod._encode_chunk

    def counting(texts, begins, ends, w=None):
        counts.append(sum(map(len, texts)))
        return encode(texts, begins, ends, w)

    monkeypatch.setattr(encode_mod, "_encode_chunk", counting)
    return counts


def test_an_interrupted_build_continues_from_its_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Interrupted (Ctrl-C) after some work: the next prepare keeps the journaled tokens, the trained BPE
    and the overlap check's state, cuts back what was written after the journal, and ends with the store
    an uninterrupted build makes. (With worker processes: the killed prepare below.)"""
    corpus = write_corpus(tmp_path / "c.txt", DOCS * 4)
    val = write_corpus(tmp_path / "v.txt", [*DOCS[::3], "held out"])  # 40 of 41 also in the training text
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 1000)  # a resume point every 1000 bytes...
    monkeypatch.setattr(build_mod, "JOURNAL_SECONDS", 0)  # ...and a journal at each
    monkeypatch.setattr(encode_mod, "CHUNK_CHARS", 2000)
    cfg = lambda cache: data_cfg(corpus, tmp_path / cache, val_paths=(str(val),), tokenize_workers=1)
    with pytest.warns(DataWarning, match="40 of 41 validation documents"):
        whole = prepare(cfg("whole"))
    write, written = encode_mod.SplitWriter.write, []

    def interrupted(self, *args):
        write(self, *args)
        written.append(self.split)
        if written.count("train") == 20:  # after the journal: this chunk is written again
            raise KeyboardInterrupt

    monkeypatch.setattr(encode_mod.SplitWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg("cut"))
    at = _journal(tmp_path / "cut")["at"]
    assert at["split"] == "train" and 0 < at["point"]["offset"] < corpus.stat().st_size
    monkeypatch.setattr(encode_mod.SplitWriter, "write", write)
    monkeypatch.setattr(build_mod, "_make_tokenizer", lambda *a: pytest.fail("the BPE was trained again"))
    capsys.readouterr()
    tokenized = _count_tokenized(monkeypatch)
    with pytest.warns(DataWarning, match="40 of 41 validation documents"):
        resumed = prepare(cfg("cut"))
    assert "continuing the interrupted build" in capsys.readouterr().out
    assert 0 < sum(tokenized) <= corpus.stat().st_size - at["point"]["offset"]  # only what follows the point
    _assert_same_store(resumed, whole)


def test_without_a_terminal_progress_is_a_line_now_and_then_with_the_rate_and_an_eta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """In a log file or CI a progress bar's carriage returns pile up: lines instead (stderr is no terminal
    under pytest)."""
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(progress_mod, "PROGRESS_SECONDS", 0)  # a line at every block read
    prepare(data_cfg(write_corpus(tmp_path / "c.txt", DOCS), tmp_path / "cache"))
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("BPE: ")]  # its own
    assert len(lines) > 5
    assert all(
        re.fullmatch(r"tokenize: [\d.]+ MB of 0.0124 MB \(\d+%\) \| [\d.]+ MB/s \| ETA \S+", line)
        for line in lines
    )


def test_an_interrupted_build_starts_over_if_its_sources_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    corpus = write_corpus(tmp_path / "c.txt", DOCS)
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(build_mod, "JOURNAL_SECONDS", 0)
    monkeypatch.setattr(encode_mod, "CHUNK_CHARS", 2000)
    write = encode_mod.SplitWriter.write

    def interrupted(self, *args):
        write(self, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(encode_mod.SplitWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(data_cfg(corpus, tmp_path / "cut"))
    monkeypatch.setattr(encode_mod.SplitWriter, "write", write)
    write_corpus(corpus, [*DOCS[:-1], "A changed last document."])
    capsys.readouterr()
    again = prepare(data_cfg(corpus, tmp_path / "cut"))
    assert "the source files changed since; starting over" in capsys.readouterr().out
    _assert_same_store(again, prepare(data_cfg(corpus, tmp_path / "fresh")))


KILLED_PREPARE = """
import sys, time
import minigpt.data.build as build
import minigpt.data.encode as encode
from minigpt.config import ConfigError, DataConfig

build.JOURNAL_SECONDS = 0  # a journal at every resume point (1 MiB of text)
encode.CHUNK_CHARS = 1 << 18
write = encode.SplitWriter.write

def slow_write(self, *args):  # slow enough to be killed half-way, however fast or busy the machine
    write(self, *args)
    time.sleep(0.05)

encode.SplitWriter.write = slow_write
train, val, gpt2, cache, workers = sys.argv[1:]
build.prepare(DataConfig(paths=(train,), val_paths=(val,), tokenizer="gpt2", gpt2_dir=gpt2, cache_dir=cache,
                         tokenize_workers=int(workers)))
"""


def _proc_stat(pid: int | str) -> list[str]:
    """A process's state, parent, ... (Linux /proc; [] if it is gone or there is no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of each child: a pid alone may be reused once its process has gone."""
    stats = {int(p.name): _proc_stat(p.name) for p in Path("/proc").glob("[0-9]*")}
    return [(child, stat[19]) for child, stat in stats.items() if stat[1:2] == [str(pid)]]


def _running(procs: list[tuple[int, str]]) -> list[int]:
    """The processes of `procs` still running: not gone, not a zombie, and not another process under the pid."""
    running = []
    for pid, start in procs:
        stat = _proc_stat(pid)
        if stat[:1] not in ([], ["Z"], ["X"]) and stat[19:20] == [start]:
            running.append(pid)
    return running


@pytest.mark.slow
def test_a_killed_prepare_resumes_and_makes_the_same_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tinystories: Path, gpt2_dir: Path
) -> None:
    """kill -9 in the middle of tokenizing real text with worker processes: the workers leave too, and the
    next prepare continues from the journal and makes the store an uninterrupted one makes."""
    text = (tinystories / "train.txt").read_bytes()[:3_000_000]
    train = tmp_path / "train.txt"
    train.write_bytes(text[: text.rindex(b"<|endoftext|>")])
    val = tinystories / "valid.txt"
    args = [str(train), str(val), str(gpt2_dir), str(tmp_path / "cut"), "2"]
    child = subprocess.Popen([sys.executable, "-c", KILLED_PREPARE, *args], env=subprocess_env())
    deadline = time.monotonic() + 120
    while True:  # until the journal shows tokens of the training file written
        assert child.poll() is None, "prepare ended before it was killed"
        assert time.monotonic() < deadline, "no journal of training text after 120 s"
        try:
            at = _journal(tmp_path / "cut")["at"]
        except (ValueError, OSError):
            at = {}
        if at.get("split") == "train" and (at["point"] or {}).get("offset", 0) > 0:
            break
        time.sleep(0.02)
    workers = _children(child.pid)
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert len(workers) >= 2 or not Path("/proc").is_dir()  # the two workers (and a resource tracker)
    deadline = time.monotonic() + 30
    while _running(workers) and time.monotonic() < deadline:  # orphans notice within a second or so
        time.sleep(0.1)
    assert not _running(workers)
    at = _journal(tmp_path / "cut")["at"]  # the last journal before the kill
    cfg = lambda cache: DataConfig(
        paths=(str(train),),
        val_paths=(str(val),),
        tokenizer="gpt2",
        gpt2_dir=str(gpt2_dir),
        cache_dir=str(tmp_path / cache),
        tokenize_workers=1,
    )
    whole = prepare(cfg("whole"))
    tokenized = _count_tokenized(monkeypatch)
    resumed = prepare(cfg("cut"))
    assert 0 < sum(tokenized) <= train.stat().st_size - at["point"]["offset"]  # the journaled part: not again
    _assert_same_store(resumed, whole)


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
        with pytest.warns(DataWarning, match=f"{message} \\(in {val.resolve()}\\) also occur in the"):
            store = prepare(data_cfg(corpus, tmp_path / "cache", val_paths=(str(val),)))
        assert any("also occur in the training text" in w for w in store.meta["warnings"])
    held_out = write_corpus(tmp_path / "held_out.txt", [*DOCS[100:], DOCS[0]])  # one in 21 is no alarm
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        store = prepare(
            data_cfg(
                write_corpus(tmp_path / "train.txt", DOCS[:100]),
                tmp_path / "cache",
                val_paths=(str(held_out),),
            )
        )
    assert store.meta["warnings"] == []


# ------------------------------------------------------------------------------------- builds for a run's tokens


def test_a_build_for_a_run_pauses_and_later_runs_extend_it_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A run that reads N tokens gets a store of (a little more than) N; one that needs more extends the same
    store, only appending, so an open map of the first tokens reads on; prepare then makes the whole store."""
    corpus = write_corpus(tmp_path / "c.txt", DOCS * 8)
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 1000)  # a resume point (a place to pause) every 1000 bytes
    monkeypatch.setattr(encode_mod, "CHUNK_CHARS", 2000)
    monkeypatch.setattr(build_mod, "PREFIX_MIN_TOKENS", 0)
    cfg = data_cfg(corpus, tmp_path / "cache")
    whole = prepare(data_cfg(corpus, tmp_path / "whole"))
    capsys.readouterr()
    first = prepare(cfg, train_tokens=2000)
    said = capsys.readouterr().out
    assert (
        f"tokenizing the first 2,100 training tokens of c.txt ({megabytes(corpus.stat().st_size)}) for this"
        in said
    )
    assert (
        f"training a 300-token byte-level BPE on the first {megabytes(2100 * 3)} of c.txt" in said
    )  # no more
    n = first.size("train")
    assert not first.complete and 2100 <= n < whole.size("train") // 4
    assert prepare(cfg, train_tokens=1000).meta == first.meta  # enough already: no work
    prepare(data_cfg(corpus, tmp_path / "other"), train_tokens=10 * corpus.stat().st_size)
    said = f"tokenizing c.txt ({megabytes(corpus.stat().st_size)}) for this run"
    assert said in capsys.readouterr().out  # more tokens than bytes: not "the first N tokens" of it
    opened = first.tokens("train")
    before = np.array(opened)
    second = prepare(cfg, train_tokens=5000)
    assert (
        f"extending the token store of c.txt ({megabytes(corpus.stat().st_size)}) from"
        in capsys.readouterr().out
    )
    assert second.path == first.path and not second.complete and second.size("train") >= 5250
    assert np.array_equal(opened, before)  # appended after, never rewritten
    assert np.array_equal(second.tokens("train")[:n], before) and second.identity == first.identity
    read = second.limited({"train": n, "val": first.size("val")})  # what a run of the first store reads
    assert np.array_equal(read.tokens("train"), before)
    assert np.array_equal(read.doc_starts("train"), first.doc_starts("train"))
    full = prepare(cfg)
    assert full.complete and full.identity == first.identity
    # The whole store made with the BPE the first run learned from its share of the text.
    alike = prepare(data_cfg(corpus, tmp_path / "alike"), tokenizer=first.tokenizer())
    for split in ("train", "val"):
        assert np.array_equal(full.tokens(split), alike.tokens(split))
        assert np.array_equal(full.doc_starts(split), alike.doc_starts(split))


def test_a_build_edited_in_place_keeping_size_and_mtime_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The journal checks the bytes read so far, not a file's size and modification time: an edit of the part
    already read, then size and mtime put back, makes the next prepare start over (and say so)."""
    corpus = write_corpus(tmp_path / "c.txt", DOCS * 4)
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(build_mod, "JOURNAL_SECONDS", 0)
    monkeypatch.setattr(encode_mod, "CHUNK_CHARS", 2000)
    write, written = encode_mod.SplitWriter.write, []

    def interrupted(self, *args):
        write(self, *args)
        written.append(self.split)
        if written.count("train") == 6:
            raise KeyboardInterrupt

    monkeypatch.setattr(encode_mod.SplitWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(data_cfg(corpus, tmp_path / "cut"))
    monkeypatch.setattr(encode_mod.SplitWriter, "write", write)
    read = _journal(tmp_path / "cut")["at"]["point"]["offset"]
    assert read > 100
    st, text = corpus.stat(), corpus.read_bytes()
    corpus.write_bytes(text[:50] + text[50:100].swapcase() + text[100:])  # within what was read
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (corpus.stat().st_size, corpus.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    capsys.readouterr()
    again = prepare(data_cfg(corpus, tmp_path / "cut"))
    out = capsys.readouterr().out
    assert f"{corpus} changed in the part already read; starting over" in out, out
    _assert_same_store(again, prepare(data_cfg(corpus, tmp_path / "fresh")))


def _chat_file(path: Path, n: int = 6) -> Path:
    from fixtures.checkpoints import conversations

    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(n)))
    return path


def test_conversations_need_a_tokenizer_with_a_chat_template_and_one_kind_per_source(tmp_path: Path) -> None:
    chat = _chat_file(tmp_path / "chat.jsonl")
    with raises_config_error("chat.jsonl holds conversations: train on conversations from a transformers"):
        prepare(DataConfig(paths=(str(chat),), tokenizer="bpe", cache_dir=str(tmp_path / "cache")))
    write_corpus(tmp_path / "v.txt", DOCS[:10])
    with raises_config_error("chat.jsonl holds conversations and " + str(tmp_path / "v.txt") + " text"):
        prepare(DataConfig(paths=(str(chat),), val_paths=(str(tmp_path / "v.txt"),), cache_dir=str(tmp_path)))


def test_a_store_of_conversations_holds_each_example_flagged(tmp_path: Path, hf) -> None:
    """Each example is one document of the store, its tokens those of the chat template's text, the
    assistant's the only targets."""
    from fixtures.checkpoints import chat_tokenizer
    from minigpt.data import packing
    from minigpt.data.chat import example_tokens
    from minigpt.data.saved_tokenizer import open_pretrained

    chat_tokenizer(tmp_path / "tok", hf[1])
    chat, val = _chat_file(tmp_path / "chat.jsonl", 8), tmp_path / "val.jsonl"
    val.write_text(chat.read_text().splitlines(keepends=True)[0].replace("What", "Why"))
    cfg = DataConfig(paths=(str(chat),), val_paths=(str(val),), tokenizer="hf", hf_tokenizer=str(tmp_path / "tok"),
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    store = prepare(cfg)
    assert store.examples and store.dtype == np.uint32 and store.meta["splits"]["train"]["documents"] == 8
    tok = open_pretrained(tmp_path / "tok")
    tokens, starts = np.asarray(store.tokens("train")), [*store.doc_starts("train"), None]
    for record, a, b in zip(map(json.loads, chat.read_text().splitlines()), starts, starts[1:], strict=False):
        example = example_tokens(record, tok.chat_template(), tok)
        assert tokens[a:b].tolist() == packing.flagged(example.ids, example.assistant).tolist()


def test_a_store_of_conversations_is_named_by_the_chat_template_that_rendered_it(tmp_path: Path, hf) -> None:
    """Two checkpoints with the same tokenizer.json but other chat templates: conversations get a store each,
    rendered by each one's own template; text shares one store, and each gets its own template back from it."""
    import shutil

    from fixtures.checkpoints import GENERATION_CHATML, chat_tokenizer
    from minigpt.data import packing
    from minigpt.data.chat import example_tokens
    from minigpt.data.saved_tokenizer import open_pretrained

    chat_tokenizer(tmp_path / "plain", hf[1], template=None)  # no template: ChatML's
    shutil.copytree(tmp_path / "plain", tmp_path / "marked")
    (tmp_path / "marked" / "chat_template.jinja").write_text(GENERATION_CHATML)
    chat, text = _chat_file(tmp_path / "chat.jsonl", 8), write_corpus(tmp_path / "text.txt", DOCS[:20])
    cfg = lambda data, tok: DataConfig(paths=(str(data),), tokenizer="hf", hf_tokenizer=str(tmp_path / tok),
                                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    plain, marked = prepare(cfg(chat, "plain")), prepare(cfg(chat, "marked"))
    assert plain.path != marked.path and plain.identity != marked.identity
    tok = open_pretrained(tmp_path / "marked")
    assert marked.tokenizer().chat_template() == tok.chat_template()
    records = [json.loads(line) for line in chat.read_text().splitlines()]
    examples = [example_tokens(r, tok.chat_template(), tok) for r in records]
    assert sorted(_documents(marked)) == sorted(tuple(packing.flagged(e.ids, e.assistant)) for e in examples)
    assert sorted(_documents(marked)) != sorted(_documents(plain))
    shared = [prepare(cfg(text, name)) for name in ("plain", "marked")]
    assert shared[0].path == shared[1].path
    assert [s.tokenizer().chat_template_source for s in shared] == [None, tok.chat_template_source]


def _documents(store: TokenStore) -> list[tuple[int, ...]]:
    """Every document (example) of both splits, as a tuple of its stored tokens."""
    out = []
    for split in ("train", "val"):
        tokens, starts = np.asarray(store.tokens(split)).tolist(), [*store.doc_starts(split).tolist(), None]
        out += [tuple(tokens[a:b]) for a, b in itertools.pairwise(starts)]
    return out


def test_conversations_with_nothing_to_learn_are_refused_and_a_share_without_is_warned_about(
    tmp_path: Path, hf
) -> None:
    """No assistant message anywhere (only system and user turns): one line naming the file, not a run at loss
    0; a split where many examples have none trains, with a warning that says how many."""
    from fixtures.checkpoints import chat_tokenizer, conversations

    chat_tokenizer(tmp_path / "tok", hf[1])
    cfg = lambda path: DataConfig(paths=(str(path),), tokenizer="hf", hf_tokenizer=str(tmp_path / "tok"),
                                  cache_dir=str(tmp_path / "cache"))  # fmt: skip
    records = conversations(40)
    asking = [{"messages": [m for m in r["messages"] if m["role"] != "assistant"]} for r in records]
    silent = tmp_path / "silent.jsonl"
    silent.write_text("".join(json.dumps(r) + "\n" for r in asking))
    with raises_config_error(f"{silent.resolve()}: the "):
        prepare(cfg(silent))
    with pytest.raises(ConfigError) as e:
        prepare(cfg(silent))
    assert "have no assistant message (or completion)" in str(e.value) and "\n" not in str(e.value)
    assert not any((tmp_path / "cache" / "tokens").glob("*/meta.json"))  # nothing kept
    some = tmp_path / "some.jsonl"
    some.write_text("".join(json.dumps(r) + "\n" for r in [*records[:30], *asking[30:]]))
    with pytest.warns(
        DataWarning, match=r"some.jsonl: \d+ of the \d+ examples for training \(\d+%\) have no"
    ):
        store = prepare(cfg(some))
    assert store.meta["splits"]["train"]["without_targets"] > 0


def test_the_tokenizer_and_tokenize_steps_count_a_file_the_same_in_one_unit(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Learning the BPE and tokenizing both say a file's size on disk, in MB: the same figure for the same file
    (not the text of its documents in one line and every file together in the other)."""
    corpus, val = write_corpus(tmp_path / "c.txt", DOCS[:100]), write_corpus(tmp_path / "v.txt", DOCS[100:])
    size, val_size = megabytes(corpus.stat().st_size), megabytes(val.stat().st_size)
    prepare(data_cfg(corpus, tmp_path / "cache", val_paths=(str(val),)), train_tokens=10**9)
    out = capsys.readouterr().out
    assert f"training a 300-token byte-level BPE on the training documents of c.txt ({size})\n" in out
    assert re.search(rf"^BPE: \d+ tokens learned from {size} of text in ", out, re.MULTILINE), out
    assert f"tokenizing c.txt ({size}) and, for validation, v.txt ({val_size}) for this run\n" in out
    assert [megabytes(n) for n in (6_947_785, 361_305, 606e6, 19e8, 12_400)] == [
        "6.95 MB", "0.361 MB", "606 MB", "1,900 MB", "0.0124 MB"
    ]  # fmt: skip


def test_a_build_for_a_run_sizes_its_workers_by_what_it_reads_not_the_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that reads the first tokens of a big corpus tokenizes them in this process: starting a worker
    per core would cost more than the little it tokenizes."""
    monkeypatch.setattr(encode_mod, "AUTO_WORKERS_MIN_BYTES", 20_000)
    monkeypatch.setattr(encode_mod, "usable_cores", lambda: 4)
    monkeypatch.setattr(build_mod, "PREFIX_MIN_TOKENS", 0)
    corpus = write_corpus(tmp_path / "c.txt", DOCS * 8)
    assert encode_mod.auto_workers(0, corpus.stat().st_size) == 4  # the whole corpus would get workers
    store = prepare(data_cfg(corpus, tmp_path / "cache"), train_tokens=1000)
    assert store.meta["build"]["workers"] == 1
