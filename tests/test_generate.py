"""Sampling: greedy is deterministic, seeds control randomness, top-k never leaves its set, context is respected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minigpt.config import ConfigError, ModelConfig
from minigpt.generate import generate, generate_ids, sample_logits
from minigpt.model import GPT
from minigpt.tokenizer import BPETokenizer


@pytest.fixture(scope="module")
def setup():
    tok = BPETokenizer.train(["the cat sat on the mat and the dog ran far away"] * 30, vocab_size=280)
    cfg = ModelConfig(vocab_size=tok.vocab_size, max_seq_len=24, d_model=32, n_layers=1, n_heads=4, d_ff=64)
    graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
    return graphdef, params, tok


def _gen(setup, prompt="the cat", **kw):
    graphdef, params, tok = setup
    args = {"max_new_tokens": 10, "max_seq_len": 24, "key": jax.random.PRNGKey(0), **kw}
    return generate(graphdef, params, tok, prompt, **args)


def test_greedy_is_deterministic_and_seeds_control_sampling(setup) -> None:
    assert _gen(setup, temperature=0.0) == _gen(setup, temperature=0.0, key=jax.random.PRNGKey(9))
    a = _gen(setup, temperature=1.0, num_samples=4)
    assert a == _gen(setup, temperature=1.0, num_samples=4)
    assert a != _gen(setup, temperature=1.0, num_samples=4, key=jax.random.PRNGKey(1))
    assert len(set(a)) > 1  # samples in one batch differ too
    assert all(t.startswith("the cat") for t in a)


def test_top_k_samples_only_from_the_k_most_likely() -> None:
    logits = jnp.log(jnp.array([[0.05, 0.3, 0.1, 0.25, 0.2, 0.1]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)
    draws = np.asarray(jax.vmap(lambda k: sample_logits(logits, k, 1.0, 3))(keys))[:, 0]
    assert set(draws.tolist()) == {1, 3, 4}
    # within the set, frequencies follow the renormalised probabilities 0.3 : 0.25 : 0.2
    freq = np.bincount(draws, minlength=6)[[1, 3, 4]] / len(draws)
    np.testing.assert_allclose(freq, np.array([0.3, 0.25, 0.2]) / 0.75, atol=0.04)


def test_prompt_longer_than_the_context_and_bad_values_are_refused(setup) -> None:
    with pytest.raises(ConfigError, match="the model's context is 24"):
        _gen(setup, prompt="the cat sat on the mat " * 10)
    with pytest.raises(ConfigError, match="temperature must be >= 0"):
        _gen(setup, temperature=-1.0)


def test_generation_stops_at_the_context_end(setup) -> None:
    graphdef, params, tok = setup
    prompt = tok.encode("the cat sat on the mat and the dog")
    kw = {"eot_id": -1, "max_seq_len": 24, "key": jax.random.PRNGKey(0), "temperature": 1.0}
    (new,) = generate_ids(graphdef, params, prompt, max_new_tokens=100, **kw)
    assert len(new) == 24 - len(prompt)  # never past the position table
    (short,) = generate_ids(graphdef, params, prompt, max_new_tokens=3, **kw)
    assert len(short) == 3


def test_sampling_stops_at_end_of_text(setup) -> None:
    graphdef, params, tok = setup
    # Make end-of-text the model's certain choice by biasing the output layer toward it.
    biased = jax.tree.map(lambda x: x, params)
    biased["lm_head"]["bias"][...] = biased["lm_head"]["bias"][...].at[tok.eot_id].set(1e4)
    kw = {"max_seq_len": 24, "key": jax.random.PRNGKey(0), "temperature": 1.0, "max_new_tokens": 10}
    assert generate_ids(graphdef, biased, tok.encode("the"), eot_id=tok.eot_id, **kw) == [[]]
