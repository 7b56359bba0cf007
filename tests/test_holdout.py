"""Which documents are held out for validation: a single book with no documents marked in it is read by its
paragraphs, said first, rather than refused as one document none of which could be held out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DOCS, data_cfg, stored_docs

from minigpt.cli import main
from minigpt.data.build import prepare
from minigpt.data.store import TokenStore

BOOK = "\n\n".join(f"Chapter {i // 10}, paragraph {i}.\n{doc}" for i, doc in enumerate(DOCS * 2))


def _prepare(capsys: pytest.CaptureFixture, *flags: str) -> tuple[str, TokenStore]:
    main(["prepare", *flags, "--data.bpe-vocab-size", "300"])
    said = capsys.readouterr().out
    path = next(line for line in said.splitlines() if line.startswith("token store: ")).split()[2]
    return said, TokenStore(Path(path), json.loads((Path(path) / "meta.json").read_text()))


def test_a_single_book_is_read_by_its_paragraphs_and_says_so_first(tmp_path: Path, capsys) -> None:
    """The README's `--data book.txt` on a plain book: its blank-line paragraphs are the documents, 5% of
    them held out, and the first line says so; the same file with --val-data, or marked with <|endoftext|>,
    is read as before."""
    book = tmp_path / "book.txt"
    book.write_text(BOOK)
    said, store = _prepare(capsys, "--data", str(book), "--data.cache-dir", str(tmp_path / "cache"))
    assert said.splitlines()[0] == (
        "book.txt has no <|endoftext|> lines: its blank-line paragraphs are its documents, 5% of them held out "
        "for validation (as --data.separator blank-line; --val-data FILE keeps it whole)"
    )
    paragraphs = [p.strip() for p in BOOK.split("\n\n")]
    assert sorted(stored_docs(store, "train") + stored_docs(store, "val")) == sorted(paragraphs)
    assert 0 < store.meta["splits"]["val"]["documents"] < len(paragraphs) // 5
    val = tmp_path / "val.txt"
    val.write_text("Another book, kept whole.")
    said, store = _prepare(
        capsys, "--data", str(book), "--val-data", str(val), "--data.cache-dir", str(tmp_path / "c2")
    )
    assert "blank-line paragraphs" not in said and store.meta["splits"]["train"]["documents"] == 1
    marked = tmp_path / "marked.txt"
    marked.write_text("One story.\n<|endoftext|>\nAnother story.\n<|endoftext|>\n")
    store = prepare(data_cfg(marked, tmp_path / "c3"))  # documents marked: read by them, nothing said
    assert (
        "blank-line paragraphs" not in capsys.readouterr().out and store.meta["options"]["separator"] == "eot"
    )
