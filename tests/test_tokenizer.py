"""Tokenizers: GPT-2 BPE offline from local files, trained byte-level BPE, and the bytes-per-token table."""

from __future__ import annotations

import random
import re
import string
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import DOCS

from minigpt.config import ConfigError
from minigpt.data.saved_tokenizer import load_tokenizer
from minigpt.data.tokenizer import (
    BPE_TRAIN_MAX_RUN,
    EOT,
    BPETokenizer,
    GPT2Tokenizer,
    _capped_runs,
    find_gpt2_files,
)

TEXT = "Once upon a time, Lily saw a café — naïve “quotes” and emoji 🐱 too.\n  Spaces  and\ttabs 123."


def test_gpt2_round_trips_offline_and_matches_known_ids(gpt2_dir: Path, tinystories: Path) -> None:
    tok = GPT2Tokenizer(find_gpt2_files(str(gpt2_dir)))
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's published ids
    assert tok.decode(tok.encode(TEXT)) == TEXT
    story = (tinystories / "valid.txt").read_text()[:5000]
    assert tok.decode(tok.encode(story)) == story
    assert tok.eot_id == 50256 and tok.vocab_size == 50257


def test_gpt2_files_folder_must_hold_both_files(tmp_path: Path) -> None:
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(ConfigError, match=r"lacks encoder\.json"):
        find_gpt2_files(str(tmp_path))


def test_token_bytes_sum_to_the_utf8_length(gpt2_dir: Path) -> None:
    gpt2 = GPT2Tokenizer(gpt2_dir)
    bpe = BPETokenizer.train([TEXT * 3, "another document about cats"] * 20, vocab_size=300)
    for tok in (gpt2, bpe):
        table = tok.token_bytes()
        assert table.sum() > 0 and table[tok.eot_id] == 0
        ids = tok.encode(TEXT)
        assert int(table[np.array(ids)].sum()) == len(TEXT.encode("utf-8"))


def test_trained_bpe_round_trips_and_reloads(tmp_path: Path) -> None:
    tok = BPETokenizer.train([TEXT, "the cat sat on the mat"] * 50, vocab_size=300)
    assert tok.vocab_size <= 300 and tok.encode(EOT) != [tok.eot_id]  # EOT is never produced from text
    assert tok.decode(tok.encode(TEXT)) == TEXT
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.identity == tok.identity and again.encode(TEXT) == tok.encode(TEXT)


def test_loading_a_folder_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tokenizer saved"):
        load_tokenizer(tmp_path)


def test_batch_encoding_matches_single_and_vocab_hash_names_the_vocabulary(
    gpt2_dir: Path, tmp_path: Path
) -> None:
    texts = [TEXT, "", "the cat sat on the mat", TEXT[::-1]]
    gpt2 = GPT2Tokenizer(gpt2_dir)
    bpe = BPETokenizer.train([TEXT, "the cat sat on the mat"] * 50, vocab_size=300)
    for tok in (gpt2, bpe):
        single = [tok.encode(t) for t in texts]
        assert tok.encode_batch(texts) == single == tok.encode_batch(texts, num_threads=1)
        tok.save(tmp_path / tok.identity)
        assert load_tokenizer(tmp_path / tok.identity).vocab_hash == tok.vocab_hash
    other = BPETokenizer.train(["a different corpus of words"] * 50, vocab_size=300)
    assert len({gpt2.vocab_hash, bpe.vocab_hash, other.vocab_hash}) == 3
    assert bpe.identity.startswith("bpe") and bpe.vocab_hash.startswith(bpe.identity.split("-")[1])


def test_bpe_training_on_long_runs_without_spaces_is_fast(tmp_path: Path) -> None:
    rng = random.Random(0)
    letters = "".join(rng.choices(string.ascii_letters, k=1_000_000))  # base32, DNA, unspaced scripts
    blanks = "".join(rng.choices(" \t\n", k=300_000))  # padding
    started = time.perf_counter()
    tok = BPETokenizer.train([letters, f"a{blanks}b", TEXT], vocab_size=300)
    seconds = time.perf_counter() - started
    assert seconds < 30, f"{seconds:.1f} s (over a minute before pre-tokens were capped)"
    sample = letters[:5000] + blanks[:2000] + TEXT
    assert tok.decode(tok.encode(sample)) == sample  # encoding sees the runs whole, as ever


def test_the_run_cap_leaves_ordinary_text_alone() -> None:
    docs = [*DOCS, TEXT, "x" * 256 + " " + " " * 255 + "y"]  # runs up to the cap are ordinary too
    capped = BPETokenizer.train(docs, vocab_size=400)
    assert capped.vocab_hash == BPETokenizer.train(docs, vocab_size=400, max_run=None).vocab_hash
    run = "z" * 700 + " " * 600 + "end"
    pieces = list(_capped_runs([TEXT, run], BPE_TRAIN_MAX_RUN))
    assert pieces[0] == TEXT and "".join(pieces[1:]) == run
    assert [len(p) for p in pieces[1:]] == [256, 256, 188 + 256, 256, 88 + 3]  # cut every 256 of a run
    assert max(len(r) for p in pieces for r in re.findall(r"\S+|\s+", p)) == BPE_TRAIN_MAX_RUN


def test_bpe_training_says_how_far_it_has_read_and_how_long_it_took(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Training a BPE on tens of megabytes takes a while: where there is no terminal, a line of progress
    every PROGRESS_SECONDS while it reads, one when it turns to the merges, and one when it is done."""
    from minigpt.data import tokenizer as tokenizer_mod

    monkeypatch.setattr(tokenizer_mod._Reading, "PROGRESS_SECONDS", 0.0)
    tokenizer_mod.BPETokenizer.train(["one two three"] * 3, vocab_size=280)
    out = capsys.readouterr()
    assert out.err == ""  # stderr stays for problems
    lines = out.out.splitlines()
    read = [re.sub(r"in [0-9.]+ s", "in T s", line) for line in lines[:-1]]
    assert read == [
        "BPE: read 0.000013 MB of text in T s",
        "BPE: read 0.000026 MB of text in T s",
        "BPE: read 0.000039 MB of text in T s",
        "BPE: read 0.000039 MB of text in T s; learning the merges ...",
    ]
    # Three words hold 9 merges: the line says how many tokens the BPE has, not the 280 asked for.
    said = (
        r"BPE: 266 tokens learned from 0.000039 MB of text in [0-9.]+ s \(of the 280 asked: the text holds no"
    )
    assert re.match(said, lines[-1]), lines[-1]


def test_the_program_trains_its_bpe_in_a_fresh_process_to_the_same_tokenizer(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """The minigpt program keeps one malloc arena (`allocator`), whose lock the BPE trainer's threads would
    queue on (3x slower): there the BPE trains in a fresh process, to the same tokenizer, with its progress
    on stdout and nothing on stderr."""
    from minigpt.runtime import allocator

    docs = [*DOCS, TEXT] * 5
    here = BPETokenizer.train(docs, vocab_size=400)
    capfd.readouterr()
    monkeypatch.setattr(allocator, "_applied", True)
    there = BPETokenizer.train(docs, vocab_size=400)
    out = capfd.readouterr()
    assert there.vocab_hash == here.vocab_hash and there.encode(TEXT) == here.encode(TEXT)
    assert re.search(r"^BPE: \d+ tokens learned from ", out.out, re.MULTILINE), out.out
    assert out.err == ""


def test_a_trained_bpe_encodes_through_tiktoken_to_the_tokens_hf_tokenizers_gives(tinystories: Path) -> None:
    """Stores are tokenized by tiktoken running the trained BPE (several times faster than HF tokenizers):
    the same tokens, on the corpus it learned from and on text unlike it."""
    import json

    from minigpt.data.tokenizer import _rank_twin

    text = (tinystories / "train.txt").read_text()[:600_000]
    docs = [d.strip() for d in text.split(EOT) if d.strip()]
    rng = random.Random(0)
    odd = [
        TEXT, f"a {EOT} b", "don't we'll they're I'M 'S", " " * 300 + "x\n\n\n\t\r\n", "12345678901234 3.14",
        "東京タワー 🙂🙂 ñandú Ωμέγα", "def f(x):\n    return {'a': [1, 2]}\n", "x" * 5000,
        "".join(rng.choice(string.printable + "éü€🐱") for _ in range(20_000)),
    ]  # fmt: skip
    for vocab in (300, 1024):
        tok = BPETokenizer.train(docs, vocab)
        assert tok.fast is not None
        for texts in (docs[:3000], odd):
            hf = [e.ids for e in tok.tok.encode_batch(texts, add_special_tokens=False)]
            assert tok.encode_batch(texts, num_threads=1) == hf == tok.encode_batch(texts)
    spec = json.loads(tok.tok.to_str())
    assert _rank_twin({**spec, "normalizer": {"type": "NFC"}}, tok.eot_id) is None  # would change the text
    merges = spec["model"]["merges"]
    assert _rank_twin({**spec, "model": {**spec["model"], "merges": merges[::-1]}}, tok.eot_id) is None
