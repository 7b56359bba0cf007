"""Evaluation (evaluate.py): `minigpt eval`'s flags and inputs refused in one line, where task results go, the
validation line, and the install hint when lm-eval is missing. The validation loop itself is covered by
test_trainer.py and test_mixture.py, the figures end to end by test_cli.py and test_harness.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import minigpt.inference
from minigpt.config import ConfigError, TrainConfig
from minigpt.inference.evaluate import EvalConfig, format_validation, import_harness, read_texts, tasks_path


def test_task_names_split_on_commas_and_spaces_as_train_does() -> None:
    assert EvalConfig(run="r", tasks=("a,b", "c", ",d,")).tasks == ("a", "b", "c", "d")
    assert TrainConfig(eval_tasks=("a,b", "c", ",d,")).eval_tasks == ("a", "b", "c", "d")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"batches": -1}, "--batches must be >= 0"),
        ({"batch_size": 0}, "--batch-size and --tensor must be >= 1"),
        ({"tensor": 0}, "--batch-size and --tensor must be >= 1"),
        ({"limit": 0.0}, "--limit must be > 0 (a count, or a fraction below 1), got 0.0"),
    ],
)
def test_bad_flags_are_one_line(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        EvalConfig(run="r", **flags)


def test_texts_that_cannot_be_measured_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Once upon a time.")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("Málaga".encode("latin-1"))
    assert read_texts((str(tmp_path / "a.txt"),)) == ["Once upon a time."]
    with pytest.raises(ConfigError, match=r"empty\.txt is empty: there is nothing to measure"):
        read_texts((str(tmp_path / "a.txt"), str(tmp_path / "empty.txt")))
    for name in ("latin1.txt", "missing.txt"):
        with pytest.raises(ConfigError, match=f"cannot read --text .*{name} as UTF-8 text"):
            read_texts((str(tmp_path / name),))


def test_task_results_go_into_the_run_or_beside_the_export(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    assert tasks_path(str(tmp_path / "run"), 7) == tmp_path / "run" / "evals" / "tasks-step7.json"
    assert tasks_path(str(tmp_path / "cpu.npz"), 7) == tmp_path / "cpu-tasks-step7.json"
    assert tasks_path(str(tmp_path / "run"), 7, out="x.json") == Path("x.json")


def test_the_validation_line_names_each_source_of_a_mixture() -> None:
    assert format_validation({"loss": 1.23456, "bpb": 0.9, "tokens": 10.0}) == (
        "val loss 1.2346 | val bits/byte 0.9000"
    )
    mixed = {"loss": 1.0, "bpb": 0.5, "loss/web": 2.0, "bpb/web": 0.75}
    assert format_validation(mixed) == "val loss 1.0000 | val bits/byte 0.5000 | bpb/web 0.7500"


def test_without_lm_eval_the_hint_says_how_the_readme_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "minigpt.inference.harness", None)  # as if lm-eval were not installed
    monkeypatch.delattr(minigpt.inference, "harness", raising=False)
    with pytest.raises(ConfigError) as exc:
        import_harness("--tasks")
    assert str(exc.value).startswith("--tasks needs lm-evaluation-harness (")
    assert "pip install -e '.[eval]'" in str(exc.value) and "\n" not in str(exc.value)


def test_eval_of_conversations_is_the_loss_on_the_assistants_tokens(
    tmp_path: Path, capsys, hf: tuple
) -> None:
    """`minigpt eval --text held-out.jsonl` of conversations reports the mean loss on the assistant's tokens,
    each predicted from all before it: what transformers' model gives on the same tokens."""
    import json

    torch, transformers = hf
    from fixtures.checkpoints import chat_checkpoint
    from minigpt.cli import main
    from minigpt.data.chat import example_tokens
    from minigpt.hf import import_hf
    from minigpt.training.runs import load_model

    model = chat_checkpoint(tmp_path / "hf", (torch, transformers))
    run, _, _ = import_hf(tmp_path / "hf", tmp_path / "run")
    records = [
        {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
                      {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Blue, I think."}]},
        {"prompt": "Tom saw a", "completion": " big red ball."},
    ]  # fmt: skip
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in records))
    capsys.readouterr()
    main(["eval", "--run", str(run), "--text", str(held_out)])
    said = float(re.search(r"assistant loss ([0-9.]+)", capsys.readouterr().out)[1])
    _, _, tok, _ = load_model(run)
    nats, count = 0.0, 0
    for record in records:
        ex = example_tokens(record, tok.chat_template(), tok)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ex.ids])).logits[0].double(), -1)
        for t in range(1, len(ex.ids)):
            if ex.assistant[t]:
                nats, count = nats - float(logp[t - 1, ex.ids[t]]), count + 1
    assert abs(said - nats / count) < 1e-4


def test_a_jsonl_file_that_mixes_conversations_and_other_records_is_refused(tmp_path: Path) -> None:
    from minigpt.inference.evaluate import read_conversations

    path = tmp_path / "mixed.jsonl"
    path.write_text('{"messages": []}\n{"text": "a story"}\n')
    with pytest.raises(ConfigError, match="line 2 is neither `messages` nor a `prompt`/`completion` pair"):
        read_conversations(path)
    (tmp_path / "stories.jsonl").write_text('{"text": "a story"}\n')
    assert read_conversations(tmp_path / "stories.jsonl") is None


def test_show_prints_what_an_example_trains_on_without_loading_the_model(
    tmp_path: Path, capsys, hf: tuple
) -> None:
    """`minigpt eval --text FILE.jsonl --show N`: each example as the model reads it, the assistant's tokens
    between ⟦ ⟧, from the tokenizer alone (the checkpoint's weights are not read)."""
    import json

    torch, transformers = hf
    from fixtures.checkpoints import chat_checkpoint
    from minigpt.cli import main
    from minigpt.hf import import_hf

    chat_checkpoint(tmp_path / "hf", (torch, transformers))
    run, _, _ = import_hf(tmp_path / "hf", tmp_path / "run")
    for f in (run / "checkpoints").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")  # no weights are read
    record = {
        "messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]
    }
    (tmp_path / "c.jsonl").write_text(json.dumps(record) + "\n")
    capsys.readouterr()
    main(["eval", "--run", str(run), "--text", str(tmp_path / "c.jsonl"), "--show", "3"])
    out = capsys.readouterr().out
    assert "example 1:" in out and "example 2" not in out
    assert "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n⟦Red.<|im_end|>\n⟧" in out


def test_bits_per_byte_of_a_tokenizer_that_loses_text_are_refused_in_one_line(
    tmp_path: Path, capsys, hf: tuple
) -> None:
    """A SentencePiece-style tokenizer without byte fallback turns characters it has no piece for into <unk>:
    `prepare` refuses it, and so does every `eval --text`, of text and of conversations, before any model is
    loaded, rather than print a bits per byte of text the tokens do not hold."""
    import json

    from conftest import cli_error

    from fixtures.checkpoints import spm_checkpoint
    from minigpt.hf import import_hf

    spm_checkpoint(tmp_path / "hf", hf)
    spec = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = False
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(spec))
    run, _, _ = import_hf(tmp_path / "hf", tmp_path / "run")
    (tmp_path / "small.txt").write_text("Tom saw a big red ball in 東京, très content.")
    capsys.readouterr()
    err = cli_error(capsys, ["eval", "--run", str(run), "--text", str(tmp_path / "small.txt")])
    assert f"--text {tmp_path / 'small.txt'}: the tokenizer changes the text it encodes" in err
    assert "so bits per byte cannot be counted" in err
    chat = {"messages": [{"role": "user", "content": "Where?"}, {"role": "assistant", "content": "東京."}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    err = cli_error(capsys, ["eval", "--run", str(run), "--text", str(tmp_path / "chat.jsonl")])
    assert f"--text {tmp_path / 'chat.jsonl'} line 1: the tokenizer changes the text it encodes" in err


def test_eval_text_of_the_validation_file_gives_the_runs_own_validation_loss(
    tmp_path: Path, capsys, sft: Path
) -> None:
    """`eval --text held-out.jsonl` reads conversations as training's validation does, examples longer than a
    window cut as training cuts them, so its loss and bits per byte are the run's validation figures; the line
    says how many were cut."""
    from minigpt.cli import main
    from minigpt.config import DataConfig
    from minigpt.hf import import_hf

    val = sft / "val.jsonl"
    data = DataConfig(paths=(str(sft / "train.jsonl"),), val_paths=(str(val),), seq_len=64,
                      cache_dir=str(tmp_path / "cache"))  # fmt: skip
    run, _, _ = import_hf(sft / "checkpoint", tmp_path / "run", data=data)
    capsys.readouterr()
    main(["eval", "--run", str(run)])
    said = capsys.readouterr().out
    own = re.search(r"val loss ([0-9.]+) \| val bits/byte ([0-9.]+)", said)
    assert own, said
    main(["eval", "--run", str(run), "--text", str(val)])
    out = capsys.readouterr().out
    text = re.search(r"assistant loss ([0-9.]+) \| ([0-9.]+) bits/byte", out)
    assert abs(float(own[1]) - float(text[1])) < 1e-4 and abs(float(own[2]) - float(text[2])) < 1e-4, out
    assert "; 2 longer than 65 tokens cut to their first 65, as training cuts them)" in out, out


def test_a_bad_conversation_in_eval_text_is_named_by_file_and_line(tmp_path: Path, capsys, sft: Path) -> None:
    import json

    from conftest import cli_error

    from minigpt.hf import import_hf

    run, _, _ = import_hf(sft / "checkpoint", tmp_path / "run")
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    bad = {"messages": [{"role": "robot", "content": "beep"}]}
    (tmp_path / "c.jsonl").write_text(f"{json.dumps(good)}\n\n{json.dumps(bad)}\n")
    err = cli_error(capsys, ["eval", "--run", str(run), "--text", str(tmp_path / "c.jsonl")])
    assert f"--text {tmp_path / 'c.jsonl'} line 3: " in err and "message 1 is not a {'role'" in err
    (tmp_path / "t.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    err = cli_error(capsys, ["eval", "--run", str(run), "--text", str(tmp_path / "t.jsonl")])
    assert f"--text {tmp_path / 't.jsonl'}: no example has an assistant message" in err
