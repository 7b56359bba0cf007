"""SentencePiece-style tokenizers (Llama 2's and Mistral's tokenizer.json): documents encode as transformers
encodes them, the dummy prefix is no text byte, so bits per byte stay exact in the store, in the eval step and
on conversations, and a checkpoint with one imports, generates transformers' greedy text and fine-tunes."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import data_cfg, raises_config_error, run_cli, write_corpus

from fixtures.checkpoints import DOCS, spm_checkpoint
from minigpt.app.initial import initial_state, with_initial
from minigpt.commands.flags import parse_train
from minigpt.data.build import prepare
from minigpt.data.pretrained_tokenizer import PretrainedTokenizer
from minigpt.data.tokenizer import dummy_tables
from minigpt.hf import export_hf, import_hf
from minigpt.training.trainer import build, make_eval_step

TEXTS = [
    *DOCS,
    " A text that starts with a space.",
    "naïve café, 東京 🙂",
    "Tabs\tand\n\nnew lines",
    "A cat typed </s> and <s> as words.",
]


@pytest.fixture(scope="module", params=["always", "first"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, hf) -> Path:
    """A Llama checkpoint with a SentencePiece-style tokenizer, its dummy prefix put as `request.param` says."""
    out = tmp_path_factory.mktemp(f"spm-{request.param}")
    spm_checkpoint(out, hf, request.param)
    return out


def test_documents_encode_as_transformers_encodes_them_and_bytes_add_up(folder: Path, hf) -> None:
    """With the BOS the checkpoint puts first, ids equal AutoTokenizer's (but where transformers drops a
    text's first space, which minigpt keeps, as SentencePiece does); the tokens' bytes, less the dummy
    prefix, are the text's, and decoding gives the text after that prefix's space."""
    tok = PretrainedTokenizer.from_checkpoint(folder)
    auto = hf[1].AutoTokenizer.from_pretrained(folder, split_special_tokens=True)
    for text in TEXTS:
        ids = tok.encode(text)
        if tok.scheme == "every" or not text.startswith(" "):
            assert [tok.bos_id, *ids] == auto(text).input_ids, text
        assert int(tok.text_bytes(ids, opened=True).sum()) == len(text.encode()), text
        assert tok.decode(ids) == " " + text
    assert tok.encode("") == [] and auto("").input_ids == [tok.bos_id]


def test_a_long_documents_later_pieces_get_no_dummy_prefix(folder: Path) -> None:
    """A document cut for length (after a line break) encodes as the whole does: only its first piece is
    prefixed."""
    tok = PretrainedTokenizer.from_checkpoint(folder)
    first, rest = "Tom saw a big red ball.\n", "He was happy and played with it all day."
    pieces = tok.encode_batch([first, rest], begins=[True, False])
    assert pieces[0] + pieces[1] == tok.encode(first + rest)


def test_the_store_and_the_eval_step_count_the_texts_bytes(folder: Path, tmp_path: Path) -> None:
    """The store's byte count is the text's, and the eval step, counting each target's bytes (a document's
    first token less its dummy prefix), finds the same bytes in the validation split."""
    held_out = ["Zoe read a book under a tree.", "Über den Fluß: 東京 🙂\nThe end."]
    train, val = write_corpus(tmp_path / "t.txt", TEXTS * 3), write_corpus(tmp_path / "v.txt", held_out)
    argv = ["--init-from", str(folder), "--data", str(train), "--val-data", str(val), "--batch-size", "1"]
    cfg = with_initial(parse_train([*argv, "--data.cache-dir", str(tmp_path / "cache")], "minigpt train"))
    store = prepare(cfg.data)
    splits = store.meta["splits"]
    assert splits["val"]["text_bytes"] == sum(len(t.encode()) for t in held_out)
    assert splits["train"]["text_bytes"] == 3 * sum(len(t.strip().encode()) for t in TEXTS)  # read stripped
    tokens = np.asarray(store.tokens("val"), np.int32)[None]
    assert tokens.shape[1] <= cfg.model.max_seq_len
    setup = build(cfg)
    tok = store.tokenizer()
    step = make_eval_step(setup, tok.token_bytes(), dummy_tables(tok, examples=False))
    out = step(initial_state(setup).params, jnp.asarray(tokens), jnp.ones((1,), jnp.float32))
    assert int(out["bytes"]) == splits["val"]["text_bytes"]


def test_a_tokenizer_that_loses_bytes_is_refused_in_one_line(folder: Path, tmp_path: Path) -> None:
    """Without byte fallback, characters with no piece become <unk>: bits per byte could not be counted."""
    lossy = tmp_path / "lossy"
    lossy.mkdir()
    for f in folder.glob("*.json"):
        (lossy / f.name).write_bytes(f.read_bytes())
    spec = json.loads((lossy / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = False
    (lossy / "tokenizer.json").write_text(json.dumps(spec))
    corpus = write_corpus(tmp_path / "c.txt", TEXTS * 4)
    with raises_config_error("the tokenizer changes the text it encodes"):
        prepare(data_cfg(corpus, tmp_path / "cache", tokenizer="hf", hf_tokenizer=str(lossy), seq_len=16))


@pytest.fixture(scope="module")
def llama2(tmp_path_factory: pytest.TempPathFactory, hf) -> Path:
    """A Llama checkpoint with a tokenizer as Llama 2's (its dummy prefix before every stretch of text)."""
    out = tmp_path_factory.mktemp("llama2")
    spm_checkpoint(out, hf, "always")
    return out


def test_a_checkpoint_with_one_generates_transformers_greedy_text_and_fine_tunes(
    llama2: Path, tmp_path: Path, hf
) -> None:
    """Imported, it writes transformers' greedy text; it continues pretraining on text and exports with its
    tokenizer, and trains LoRA adapters on Llama 2 style conversations, whose assistant-token loss and
    bytes `eval --text` reports."""
    from minigpt.inference.generate import SamplingConfig, generate_ids
    from minigpt.training.runs import load_model

    torch, transformers = hf
    import_hf(llama2, tmp_path / "imported")
    setup, params, tok, _ = load_model(tmp_path / "imported")
    prompt = [tok.bos_id, *tok.encode("Tom saw a big")]
    assert prompt == transformers.AutoTokenizer.from_pretrained(llama2)("Tom saw a big").input_ids
    mine = generate_ids(setup.graphdef, params, prompt, SamplingConfig(max_new_tokens=12, temperature=0.0),
                        eot_id=tok.eot_id, max_seq_len=setup.cfg.model.max_seq_len, stop_ids=tok.stop_ids)[0]  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(llama2).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=12)[0, len(prompt):].tolist()  # fmt: skip
    stops = [i for i, t in enumerate(out) if t in tok.stop_ids]
    assert mine == out[: stops[0] if stops else None] and len(mine) >= 3
    corpus = write_corpus(tmp_path / "c.txt", [f"{t} ({i})" for i in range(8) for t in TEXTS])
    val = write_corpus(tmp_path / "v.txt", [f"{t} (held out)" for t in TEXTS])
    _train(llama2, tmp_path, "text", "--data", str(corpus), "--val-data", str(val), "--data.seq-len", "32")
    export_hf(tmp_path / "text", tmp_path / "hf")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", split_special_tokens=True)
    assert all(exported(t).input_ids == [tok.bos_id, *tok.encode(t)] for t in TEXTS if not t.startswith(" "))
    chats = tmp_path / "chats.jsonl"
    from fixtures.checkpoints import conversations

    examples = conversations(12)
    chats.write_text("".join(json.dumps(c) + "\n" for c in examples))
    _train(llama2, tmp_path, "lora", "--data", str(chats), "--lora.rank", "4", "--data.seq-len", "128")
    said = run_cli("eval", "--run", str(tmp_path / "lora"), "--text", str(chats)).stdout
    # The assistant's text is what the template adds for each reply: " " + content + " " (and the eos).
    replies = [m["content"] for c in examples for m in c["messages"] if m["role"] == "assistant"]
    assert f"of 12 examples, {sum(len(r.encode()) + 2 for r in replies)} bytes)" in said


def _train(source: Path, tmp_path: Path, run: str, *flags: str) -> None:
    """`minigpt train --init-from source` for 3 steps of 2 rows, in this process."""
    from minigpt.app.train import train

    argv = ["--init-from", str(source), "--steps", "3", "--batch-size", "2", "--mesh.cpu-devices", "1",
            "--data.cache-dir", str(tmp_path / "cache"), "--run-dir", str(tmp_path / run), *flags]  # fmt: skip
    train(with_initial(parse_train(argv, "minigpt train")))


def test_a_unigram_tokenizer_with_byte_fallback_counts_bytes_exactly() -> None:
    """SentencePiece's other model (T5's, Gemma's ancestors'): Unigram pieces, with <0xNN> byte pieces for
    what it has no piece for."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    learner = Tokenizer(models.Unigram())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    learner.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    learner.train_from_iterator(DOCS * 20, trainers.UnigramTrainer(vocab_size=120, show_progress=False))
    spec = json.loads(learner.to_str())
    pieces = [["<unk>", 0.0], ["<s>", 0.0], ["</s>", 0.0], *([f"<0x{b:02X}>", -20.0] for b in range(256))]
    spec["model"].update(vocab=pieces + spec["model"]["vocab"], unk_id=0, byte_fallback=True)
    built = Tokenizer.from_str(json.dumps(spec))
    built.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok = PretrainedTokenizer(built.to_str(), 1, 2, [2])
    assert tok.scheme == "every"
    for text in TEXTS[:-1]:  # its vocabulary holds </s> as a piece, which a text spelling it would be
        ids = tok.encode(text)
        assert (
            int(tok.text_bytes(ids, opened=True).sum()) == len(text.encode())
            and tok.decode(ids) == " " + text
        )
