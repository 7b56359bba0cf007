"""`Conversation` and `minigpt chat`: each turn through the chat template, replies ending at the model's
end-of-turn, and the key/value cache carried between turns giving what reading the whole conversation again
gives."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import WORKDIR, subprocess_env
from flax import nnx

from minigpt.hf import import_hf
from minigpt.inference.conversation import Conversation
from minigpt.inference.generate import SamplingConfig
from minigpt.training.runs import load_model


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, hf: tuple) -> Path:
    """A chat model as transformers saves one (ChatML template, <|im_end|> ends a turn), imported."""
    torch, transformers = hf
    from fixtures.checkpoints import chat_checkpoint

    root = tmp_path_factory.mktemp("chat")
    chat_checkpoint(root / "hf", (torch, transformers))
    out, _, _ = import_hf(root / "hf", root / "run")
    return out


def _full_logits(setup, params, ids: list[int]) -> np.ndarray:
    """Next-token logits after `ids`, from a forward pass over all of them (no cache)."""
    model = nnx.merge(setup.graphdef, params)
    tokens = np.array([ids], np.int32)
    logits, _ = model.decode(tokens, np.arange(len(ids))[None], model.init_cache(1))
    return np.asarray(logits[0, -1])


def test_the_cache_carried_between_turns_equals_reading_the_conversation_again(run: Path) -> None:
    """Turn 2 feeds only its new tokens; its logits are those of the whole conversation read from scratch,
    whether turn 1 ended at the end-of-turn token or at the token budget."""
    setup, params, tok, _ = load_model(run)
    for budget in (3, 40):
        chat = Conversation(
            setup, params, tok, SamplingConfig(max_new_tokens=budget, temperature=0.0), "Be brief."
        )
        chat.say("Tom saw a big red ball.")
        prompt = chat.template.render(
            [*chat.messages, {"role": "user", "content": "Lily went to the park."}], True
        )
        ids = chat.ids + tok.encode_chat(prompt.text[len(chat.text) :])
        assert prompt.text.startswith(chat.text)  # so only the new turn's tokens are fed
        fed = chat._feed(ids)
        assert np.abs(np.asarray(fed[0]) - _full_logits(setup, params, ids)).max() < 1e-4


def test_a_reply_ends_at_the_end_of_turn_and_the_template_renders_it_back(run: Path) -> None:
    """A reply stops at the first of the model's stop tokens (here one it was going to write anyway), the
    token itself not in the reply."""
    setup, params, tok, _ = load_model(run)
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    free = Conversation(setup, params, tok, greedy)
    free.say("Hello there.")
    prompt = free.template.render([{"role": "user", "content": "Hello there."}], add_generation_prompt=True)
    written = free.ids[len(tok.encode_chat(prompt.text)) :]
    written = written[:-1] if written[-1] in tok.stop_ids else written  # its own end of turn
    stop = next(t for i, t in enumerate(written) if i >= 2 and t not in written[:i])
    ends = copy.copy(tok)
    ends.stop_ids = (stop,)
    chat = Conversation(setup, params, ends, greedy)
    reply = chat.say("Hello there.")
    assert chat.ids[-1] == stop and chat.ids[-1 - written.index(stop) : -1] == written[: written.index(stop)]
    assert reply == tok.decode(written[: written.index(stop)])
    # The template writes its own end of turn after a reply, not this stop token: the next turn reads the
    # conversation again, and goes on as well.
    assert isinstance(chat.say("And then?"), str) and chat.turns == 2


def test_minigpt_chat_talks_turn_by_turn_from_standard_input(run: Path) -> None:
    turns = "Tom saw a ball.\nWhat colour was it?\n/exit\nnever read\n"
    out = subprocess.run(
        [sys.executable, "-m", "minigpt.cli", "chat", "--run", str(run), "--system", "Be brief.",
         "--max-new-tokens", "6", "--temperature", "0"],
        input=turns, capture_output=True, text=True, env=subprocess_env(), cwd=WORKDIR, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("Traceback") == 0
    # piped: a transcript, every turn marked (a reply may span lines), up to /exit
    assert out.stdout.startswith("you> Tom saw a ball.\nmodel> ")
    turns = [line for line in out.stdout.splitlines() if line.startswith(("you> ", "model> "))]
    assert [t.split("> ")[0] for t in turns] == ["you", "model", "you", "model"], out.stdout
    assert turns[2] == "you> What colour was it?" and "never read" not in out.stdout


def test_import_of_a_chat_checkpoint_says_how_to_talk_with_it(run: Path, tmp_path: Path, capsys) -> None:
    from minigpt.cli import main

    main(["import", "--hf", str(run.parent / "hf"), "--out", str(tmp_path / "again")])
    assert f"talk with it: minigpt chat --run {tmp_path / 'again'}" in capsys.readouterr().out


def test_a_model_without_a_chat_tokenizer_is_refused_in_one_line(tiny_run) -> None:
    from minigpt.runtime.errors import ConfigError

    _, _, plain = tiny_run
    setup, params, tok, _ = load_model(plain)
    with pytest.raises(ConfigError, match="has no chat template"):
        Conversation(setup, params, tok, SamplingConfig())
