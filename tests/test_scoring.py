"""Scoring: requests that share a context share a row, and every request still gets exactly the log-likelihood
and greedy flag of scoring it alone with the full logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minigpt.config import DataConfig, ModelConfig, TrainConfig
from minigpt.inference.scoring import Scorer, pack
from minigpt.training.trainer import build, init_state

MODEL = ModelConfig(
    vocab_size=97, max_seq_len=32, d_model=32, n_heads=4, n_layers=2, d_ff=64, position="rope", norm="rmsnorm"
)


def test_answers_to_one_question_share_its_row_at_their_own_positions() -> None:
    pairs = [([5, 6, 7], [8, 9]), ([5, 6, 7], [10]), ([1, 2], [3, 4, 5]), ([5, 6, 7], [11, 12, 13])]
    rows = pack(pairs, max_length=32)
    assert len(rows) == 2
    shared = rows[0]
    assert shared.tokens == [5, 6, 7, 8, 11, 12]  # each answer's last token is only a target
    assert shared.segments == [0, 0, 0, 1, 3, 3]  # (answer 2, one token, adds no input)
    assert shared.positions == [0, 1, 2, 3, 3, 4]  # every answer right after the question
    # answer [8, 9]: 8 is predicted at the question's last token (index 2), 9 after 8 (index 3)
    assert shared.scored == [(0, [2, 3], [8, 9]), (1, [2], [10]), (3, [2, 4, 5], [11, 12, 13])]
    # a full row starts another with the same context
    many = pack([([1, 2, 3], [4, 5, 6, 7, 8])] * 12, max_length=32)
    assert [len(r.scored) for r in many] == [6, 6] and all(len(r.tokens) <= 32 for r in many)


def _alone(model, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """The reference: each pair alone in its own row (right-padded; causal attention never reads padding),
    the full logits' log-softmax at each target, in one forward pass."""
    rows = [[*ctx, *cont][-33:] for ctx, cont in pairs]
    tokens = np.zeros((len(rows), 33), np.int32)
    for r, row in enumerate(rows):
        tokens[r, : len(row)] = row
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(tokens[:, :-1])), axis=-1))
    out = []
    for r, (row, (_, cont)) in enumerate(zip(rows, pairs, strict=True)):
        at, targets = np.arange(len(row) - len(cont) - 1, len(row) - 1), np.asarray(row[-len(cont) :])
        out.append((float(logp[r, at, targets].sum()), bool((logp[r, at].argmax(-1) == targets).all())))
    return out


def test_packed_scores_equal_each_request_scored_alone() -> None:
    cfg = TrainConfig(model=MODEL, data=DataConfig(seq_len=32), batch_size=4)
    setup = build(cfg)
    params = init_state(setup).params
    model = nnx.merge(setup.graphdef, params)
    rng = np.random.default_rng(0)
    words = lambda n: [int(t) for t in rng.integers(1, 97, n)]
    questions = [words(n) for n in (3, 9, 20, 40)]  # the last longer than the context: cut from the left
    pairs = [(q, words(k)) for q in questions for k in (1, 2, 5)]
    pairs += [([7], [int(model(jnp.asarray([[7]])).argmax(-1)[0, 0])])]  # a greedy answer
    pairs += [(questions[0], words(3)) for _ in range(14)]  # more answers than one row holds
    scores = Scorer(setup, params, batch_size=4, progress=False).loglikelihoods(pairs)
    for pair, (logp, greedy), (want_logp, want_greedy) in zip(
        pairs, scores, _alone(model, pairs), strict=True
    ):
        assert abs(logp - want_logp) < 2e-4, (pair, logp, want_logp)
        assert greedy == want_greedy
    assert any(g for _, g in scores)


def test_a_checkpoints_bits_per_byte_are_transformers_from_its_bos(tmp_path, hf: tuple) -> None:
    """A chat checkpoint with a BOS scores a text from its BOS, as it was trained: the bits per byte equal
    transformers' negative log-likelihood of the text's tokens after <|begin_of_text|>, over its bytes."""
    import math

    torch, transformers = hf
    from fixtures.checkpoints import chat_checkpoint
    from minigpt.hf import import_hf
    from minigpt.inference.scoring import text_bits_per_byte
    from minigpt.training.runs import load_model

    model = chat_checkpoint(tmp_path / "hf", (torch, transformers))
    run, _, _ = import_hf(tmp_path / "hf", tmp_path / "run")
    setup, params, tok, _ = load_model(run)
    text = "Lily and Ben went to the park. They saw a dog, très content!"
    (row,) = text_bits_per_byte(Scorer(setup, params, progress=False), tok, [text])
    ids = [tok.bos_id, *tok.encode(text)]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    nats = -sum(float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1))
    assert row["bytes"] == len(text.encode()) and row["tokens"] == len(ids) - 1
    assert abs(row["bpb"] - nats / math.log(2) / len(text.encode())) < 1e-4
