"""Training on conversations: examples flagged in the store, packed whole into rows, the loss on the assistant's
tokens only, with the same numbers as TRL's SFTTrainer on the same checkpoint and data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sft_runs import STEPS, minigpt_config, minigpt_losses, trl_losses

from minigpt.data import packing
from minigpt.data.loader import PackedExamples


def test_best_fit_packs_every_example_once_within_the_capacity() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=500)
    rows = packing.pack(lengths, 64)
    placed = np.sort(np.concatenate(rows))
    assert np.array_equal(placed, np.arange(500))
    assert all(lengths[r].sum() <= 64 for r in rows)
    # Near the least possible: no two examples over half a row share one, and no row holds over 64 tokens.
    least = max(np.ceil(lengths.sum() / 64), (lengths > 32).sum())
    assert len(rows) <= 1.05 * least
    packing._pack.cache_clear()  # packed again, not remembered: the same rows
    assert [r.tolist() for r in rows] == [r.tolist() for r in packing.pack(lengths, 64)]


def test_flags_mark_the_start_and_the_tokens_that_are_no_targets() -> None:
    out = packing.flagged([5, 6, 7, 8], [False, False, True, True])
    assert (out & packing.ID_MASK).tolist() == [5, 6, 7, 8]
    assert [bool(t & packing.START) for t in out] == [True, False, False, False]
    assert [bool(t & packing.MASKED) for t in out] == [True, True, False, False]


def test_rows_hold_whole_examples_padded_and_longer_ones_cut(tmp_path: Path) -> None:
    examples = [
        packing.flagged(range(10 * k, 10 * k + n), [True] * n) for k, n in enumerate([3, 10, 2, 12, 4])
    ]
    tokens = np.concatenate(examples).astype(np.uint32)
    starts = np.cumsum([0] + [len(e) for e in examples[:-1]])
    rows = PackedExamples(tokens, starts, seq_len=8)
    assert rows.cut == 2  # the 10- and 12-token examples are longer than a row of 9
    got = [rows[i] for i in range(len(rows))]
    assert all(r.shape == (9,) and r.dtype == np.int32 for r in got)
    firsts = sorted(
        int(t & packing.ID_MASK) for r in got for t in r if t & packing.START and t != packing.PAD
    )
    assert firsts == [0, 10, 20, 30, 40]
    whole = {int(t) for r in got for t in r if t != packing.PAD}
    assert {0, 1, 2, 20, 21, 40, 41, 42, 43} <= {t & packing.ID_MASK for t in whole}
    assert "5 examples packed into" in rows.summary("training x") and "2 longer than a row" in rows.summary(
        "x"
    )


@pytest.mark.slow
def test_sft_loss_and_curve_equal_trls(sft: Path, hf) -> None:
    """The peer's numbers on the same checkpoint, conversations, optimizer and learning rate: the first batch's
    assistant-token loss within 1e-4, and the loss curve over 50 steps within 1%."""
    ours, theirs = minigpt_losses(minigpt_config(sft, STEPS)), trl_losses(sft, hf, STEPS)
    print("minigpt", ours[:3], ours[-3:], "\nTRL", theirs[:3], theirs[-3:])
    assert len(ours) == len(theirs) == STEPS
    assert abs(ours[0] - theirs[0]) < 1e-4
    assert np.max(np.abs(np.array(ours) / np.array(theirs) - 1)) < 1e-3  # the target is 1%
