"""Reading sources: every format, folders and globs, separators, read-block boundaries, documents split into
pieces, and bad input refused (or replaced with a warning) naming the file and position."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DOCS, data_cfg, raises_config_error, stored_docs, write_corpus

import minigpt.data.corpus as corpus_mod
from minigpt.config import DataConfig
from minigpt.data import parquet
from minigpt.data.build import prepare
from minigpt.data.corpus import read_documents, resolve_files
from minigpt.data.loader import Windows, train_iterator
from minigpt.data.tokenizer import EOT
from minigpt.runtime.errors import DataWarning

FLAT_DOCS = [d.replace("\n", " ") for d in DOCS]  # for blank-line separated files


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


# ---------------------------------------------------------------------------------------------------- sources


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_stores_every_document_once_and_an_epoch_trains_every_token_once(
    tmp_path: Path, fmt: str
) -> None:
    write, separator, docs = FORMATS[fmt]
    store = prepare(data_cfg(write(tmp_path, docs), tmp_path / "cache", separator=separator))
    assert sorted(stored_docs(store, "train") + stored_docs(store, "val")) == sorted(docs)
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
    store = prepare(data_cfg(tmp_path / "src", tmp_path / "cache", val_paths=(str(val),)))
    assert stored_docs(store, "train") == DOCS[40:80] + DOCS[:40]
    assert stored_docs(store, "val") == DOCS[80:]


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
        monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", block)
        assert read_documents(path, cfg) == docs[:30]


def test_long_documents_are_tokenized_in_pieces_exactly_and_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tinystories: Path, gpt2_dir: Path
) -> None:
    story = (tinystories / "valid.txt").read_text()[:12000].replace(EOT, "").strip()
    docs = ["short one", story, "short two", story[:3000].strip()]
    corpus = write_corpus(tmp_path / "c.txt", docs)
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 1000)  # the long document spans many reads...
    monkeypatch.setattr(corpus_mod, "PIECE_CHARS", 400)  # ...and reaches the tokenizer in pieces
    monkeypatch.setattr(corpus_mod, "LONG_DOC_BYTES", 10000)
    for tokenizer in ("gpt2", "bpe"):
        cfg = data_cfg(corpus, tmp_path / "cache", tokenizer=tokenizer, gpt2_dir=str(gpt2_dir))
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


def test_end_of_text_lines_read_as_plain_text_are_warned_about(tmp_path: Path) -> None:
    """--data.separator blank-line on text whose documents end in <|endoftext|> lines keeps the markers as
    words of the text: said once, with the flag that splits at them."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"{doc}\n{EOT}" for doc in DOCS))  # both: blank lines and markers
    with pytest.warns(
        DataWarning, match=re.escape(f"{corpus.resolve()}: 120 {EOT} lines read as plain text")
    ):
        prepare(data_cfg(corpus, tmp_path / "cache", separator="blank-line"))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reading_from_any_resume_point_yields_the_rest_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """What an interrupted prepare continues from: reading from a point `mark` gave yields the records after
    it, ends with the same counts (a long document's size included) and reports the remaining bytes."""
    write, separator, docs = FORMATS[fmt]
    docs = [*docs[:40], " ".join(docs[40:80]), *docs[80:]]  # one long document, read in pieces
    path, cfg = write(tmp_path, docs), DataConfig(separator=separator, encoding_errors="replace")
    if fmt == "txt":  # an undecodable byte early on: the replacement count carries over too
        path.write_bytes(path.read_bytes().replace(b"Doc 3:", b"Doc \xff:", 1))
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 500)  # many points, some inside the long document
    monkeypatch.setattr(corpus_mod, "PIECE_CHARS", 400)
    monkeypatch.setattr(corpus_mod, "LONG_DOC_BYTES", 2000)
    monkeypatch.setattr(parquet, "BATCH_ROWS", 8)  # points inside row groups (of 50 rows)
    records, points, stats = [], [], corpus_mod.FileStats()
    for record in corpus_mod.read_records(path, cfg, stats, mark=lambda p: points.append((len(records), p))):
        records.append(record)
    assert len(points) > 6 and stats.long_docs == 1 and stats.replaced == (fmt == "txt")
    if fmt in ("txt", "blank-line"):  # text files: some points are inside the long document
        assert any(n and not records[n - 1][2] for n, _ in points)
    for n, point in points:
        assert json.loads(json.dumps(point)) == point  # plain JSON, for the journal
        again, advanced = corpus_mod.FileStats(), []
        rest = list(corpus_mod.read_records(path, cfg, again, advanced.append, start=point))
        assert rest == records[n:] and again == stats
        assert point["bytes"] + sum(advanced) == path.stat().st_size


# -------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "training corpus is empty"),
        (b"\n<|endoftext|>\n  \n<|endoftext|>\n", "training corpus is empty"),
        (b"just one document", "--data.separator blank-line (paragraphs as documents)"),
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
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 1024)
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with raises_config_error(message):
        prepare(data_cfg(path, tmp_path / "cache"))
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
        prepare(data_cfg(path, tmp_path / "cache", encoding_errors="replace", val_fraction=0.5))
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
    with raises_config_error(message):
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
    with raises_config_error(message):
        prepare(data_cfg(path, tmp_path / "cache"))


def test_bad_parquet_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "c.parquet", DOCS[:5], field="body")
    with raises_config_error(
        'c.parquet has no "text" column (it has: id, body); choose one with --data.text-field'
    ):
        prepare(data_cfg(path, tmp_path / "cache"))
    with raises_config_error('c.parquet: column "id" holds int64, not strings'):
        prepare(data_cfg(path, tmp_path / "cache", text_field="id"))
    (tmp_path / "fake.parquet").write_text("PAR1 but not really")
    with raises_config_error("fake.parquet is not a readable Parquet file"):
        prepare(data_cfg(tmp_path / "fake.parquet", tmp_path / "cache"))


@pytest.mark.parametrize(
    ("paths", "val_paths", "message"),
    [
        (("",), (), "--data got an empty path ''"),
        (("c.txt", "  "), (), "--data got an empty path '  '"),
        (("c.txt",), ("",), "--val-data got an empty path ''"),
    ],
)
def test_empty_paths_are_refused_not_read_as_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, paths: tuple, val_paths: tuple, message: str
) -> None:
    monkeypatch.chdir(tmp_path)  # "" would mean this folder: c.txt and v.txt, validation file included
    write_corpus(tmp_path / "c.txt", DOCS[:50])
    write_corpus(tmp_path / "v.txt", DOCS[50:60])
    with raises_config_error(message):
        prepare(
            DataConfig(paths=paths, val_paths=val_paths, cache_dir=str(tmp_path / "cache"), tokenizer="bpe")
        )


def test_json_is_refused_with_how_to_make_json_lines(tmp_path: Path) -> None:
    array = tmp_path / "c.json"
    array.write_text(json.dumps([{"text": d} for d in DOCS[:5]], indent=2))
    hint = "c.json: minigpt reads JSON Lines (.jsonl, one JSON object per line), not .json; if it already"
    for given in (array, tmp_path / "*.json"):
        with raises_config_error(hint):
            prepare(data_cfg(given, tmp_path / "cache"))
    with raises_config_error("jq -c '.[]' c.json > c.jsonl"):
        read_documents(array)
    write_corpus(tmp_path / "a.txt", DOCS[:5])
    assert resolve_files([str(tmp_path)]) == [(tmp_path / "a.txt").resolve()]  # not a source in a folder
    cases = {
        "pretty.jsonl": (json.dumps([{"text": d} for d in DOCS[:5]], indent=2), "a JSON array", "'.[]'"),
        "one_line.jsonl": ("\n" + json.dumps([{"text": d} for d in DOCS[:5]]), "a JSON array", "'.[]'"),
        "object.jsonl": (json.dumps({"text": DOCS[0]}, indent=2), "one JSON object spread over lines", "."),
    }
    for name, (content, what, jq) in cases.items():
        (tmp_path / name).write_text(content)
        with raises_config_error(
            f"{name} holds {what}, not JSON Lines (one JSON object per line); convert it with jq -c {jq} {name} >"
        ):
            prepare(data_cfg(tmp_path / name, tmp_path / "cache"))


_RESOLVE_IN_A_CHILD = """
import json, sys
from minigpt.data.corpus import resolve_files
print(json.dumps([[str(f) for f in resolve_files([p])] for p in sys.argv[1:]]))
"""


def test_symlink_loops_end_in_folders_and_globs_and_symlinked_folders_are_read(tmp_path: Path) -> None:
    data, other = tmp_path / "data", tmp_path / "other"
    (data / "sub").mkdir(parents=True)
    other.mkdir()
    a = write_corpus(data / "a.txt", DOCS[:3]).resolve()
    b = write_corpus(data / "sub" / "b.txt", DOCS[3:6]).resolve()
    c = write_corpus(other / "c.txt", DOCS[6:9]).resolve()
    (data / "loop").symlink_to("..")  # to the folder holding data: would read data again, forever
    (data / "sub" / "loop").symlink_to("..")
    (data / "sub" / "self").symlink_to(".")
    (data / "sub" / "elsewhere").symlink_to(other)  # an ordinary symlinked folder is followed
    (other / "back").symlink_to(data)
    patterns = [str(data), str(data / "**" / "*.txt"), "data/**/*.txt", "**/b.txt", str(data / "**")]
    # A child process, so the test ends (failing) even where resolving never would.
    out = subprocess.run(
        [sys.executable, "-c", _RESOLVE_IN_A_CHILD, *patterns],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    everything = [
        str(a),
        str(b),
        str(c),
    ]  # sorted by the path found: data/sub/b.txt, data/sub/elsewhere/c.txt
    assert json.loads(out.stdout) == [everything, everything, everything, [str(b)], everything]


def test_unreadable_sources_are_refused_naming_the_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    for given in (fifo, tmp_path / "*.txt"):
        with raises_config_error(f"data path {fifo} is not a regular file or folder"):
            resolve_files([str(given)])
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nothing.txt")
    with raises_config_error(f"data path {tmp_path / 'gone.txt'} is a broken symbolic link (to "):
        resolve_files([str(tmp_path / "gone.txt")])
    (tmp_path / "folder.txt").mkdir()
    with raises_config_error(f"{tmp_path / 'folder.txt'} could not be read (Is a directory)"):
        read_documents(tmp_path / "folder.txt")
    if Path("/proc/self/mem").is_file():  # Linux: a regular file whose reads fail with an I/O error
        with raises_config_error("/mem could not be read (Input/output error)"):
            prepare(data_cfg("/proc/self/mem", tmp_path / "cache"))


def _records(path: Path) -> list:
    from minigpt.data.corpus import FileStats, read_records

    return list(read_records(path, DataConfig(), FileStats()))


def test_conversations_are_recognised_by_their_fields_and_kept_whole(tmp_path: Path) -> None:
    from minigpt.data.chat import ExampleRecord
    from minigpt.data.corpus import PIECE_CHARS

    long = "word " * (PIECE_CHARS // 4)
    lines = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": long}], "id": 7},
        {"prompt": "2+2=", "completion": "4"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = _records(path)
    assert [type(t) for t, _, _ in records] == [ExampleRecord, ExampleRecord]
    assert [json.loads(t) for t, _, _ in records] == [{"messages": lines[0]["messages"]}, lines[1]]
    assert all(begins and ends for _, begins, ends in records)  # never cut into pieces
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "a story", "messages": []}) + "\n")  # the text field wins
    assert _records(text) == [("a story", True, True)]


def test_conversations_in_parquet_are_read_from_their_columns(tmp_path: Path) -> None:
    """A Parquet file with a "messages" column (or "prompt" and "completion"), as chat datasets are
    published, holds examples, each row one; a bad row is named; a file of text with a conversation where the
    text was expected says where conversations are read from."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from minigpt.data.chat import ExampleRecord
    from minigpt.data.corpus import holds_examples

    chats = [
        [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Hello"}] for i in range(3)
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": chats, "source": ["a", "b", "c"]}), path)
    assert holds_examples(path, DataConfig())
    records = _records(path)
    assert [type(t) for t, _, _ in records] == [ExampleRecord] * 3
    assert [json.loads(t) for t, _, _ in records] == [{"messages": m} for m in chats]
    pairs = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"prompt": ["2+2=", "3+3="], "completion": ["4", "6"]}), pairs)
    assert [json.loads(t) for t, _, _ in _records(pairs)][1] == {"prompt": "3+3=", "completion": "6"}
    pq.write_table(pa.table({"messages": [*chats, [{"role": "robot", "content": "x"}]]}), path)
    with raises_config_error("chat.parquet row 3: message 1 is not a {'role'"):
        _records(path)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "a story"}) + "\n" + json.dumps({"messages": chats[0]}) + "\n")
    with raises_config_error(
        "text.jsonl:2 is a conversation, but the file's first record is text: one source"
    ):
        _records(text)


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"messages": [{"content": "no role"}]}, "c.jsonl:2: message 1 is not a {'role': system | user"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "c.jsonl:2: message 1 is not a {'role'"),
        ({"messages": []}, 'c.jsonl:2: "messages" must be a non-empty list'),
        (
            {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
            "c.jsonl:2: a prompt/completion",
        ),
        ({"text": "a story"}, "c.jsonl:2 is not a conversation"),
    ],
)
def test_a_bad_conversation_is_one_line_naming_the_line(tmp_path: Path, second: dict, message: str) -> None:
    first = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    with raises_config_error(message):
        _records(path)
