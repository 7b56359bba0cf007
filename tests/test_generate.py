"""Sampling with a key/value cache: it matches full recomputation (logits and tokens), batches of prompts match
one-by-one runs, seeds control randomness, top-k/top-p never leave their sets, the context is respected, and
per-document attention masking (segment_ids) keeps packed documents apart."""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_BACKEND_FLAGS
from flax import nnx
from jax.experimental import io_callback
from reference_decoder import generate_ids_full_recompute

from minigpt.config import ConfigError, ModelConfig
from minigpt.data.tokenizer import BPETokenizer
from minigpt.inference.generate import (
    STREAM_CHUNK,
    SamplingConfig,
    TextStreamer,
    _decode_chunk,
    _generate_cached,
    _prefill,
    generate,
    generate_batch,
    generate_ids,
    generate_ids_batch,
    prompt_bucket,
    sample_logits,
)
from minigpt.nn.model import GPT, decoding_params

S = 24  # the tiny model's context (position table rows)
CFG = ModelConfig(vocab_size=280, max_seq_len=S, d_model=32, n_layers=2, n_heads=4, d_ff=64)
# The seed tutorial's block: post-norm, ReLU, untied head (pre-norm + tied is the other combination).
POST = dataclasses.replace(CFG, norm_position="post", activation="relu")
TIED = dataclasses.replace(CFG, tie_embeddings=True)
VALUES = dataclasses.replace(CFG, n_layers=3, value_residual=True, value_embeddings=2)


@pytest.fixture(scope="module")
def setup():
    tok = BPETokenizer.train(["the cat sat on the mat and the dog ran far away"] * 30, vocab_size=280)
    cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size, n_layers=1)
    graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
    return graphdef, params, tok


def _gen(setup, prompt="the cat", **kw):
    graphdef, params, tok = setup
    return generate(graphdef, params, tok, prompt, **_text_kw(**{"max_new_tokens": 10, **kw}))


SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingConfig)}


def _text_kw(**kw):
    """Keywords for the tiny model: its context, and a SamplingConfig of the sampling fields in kw over the
    tests' own defaults (temperature 1 over every token, 30 new tokens); the rest of kw passes through."""
    sampling = {"max_new_tokens": 30, "temperature": 1.0, "top_k": 0}
    sampling |= {k: v for k, v in kw.items() if k in SAMPLING_FIELDS}
    rest = {k: v for k, v in kw.items() if k not in SAMPLING_FIELDS}
    return {"max_seq_len": S, "sampling": SamplingConfig(**sampling), **rest}


def _ids_kw(**kw):
    return _text_kw(**{"eot_id": -1, **kw})


# ---- the cache against full recomputation ----


@functools.cache
def _jitted(cfg: ModelConfig):
    """(full forward, cached decode, empty cache) of a fresh model, compiled (eager dispatch is slow); one per
    config, so tests of the same model share its compiled programs."""
    graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
    full = jax.jit(lambda tokens: nnx.merge(graphdef, params)(tokens))
    decode = jax.jit(lambda *a, **k: nnx.merge(graphdef, params).decode(*a, **k))
    return full, decode, lambda b: nnx.merge(graphdef, params).init_cache(b)


@pytest.mark.parametrize(
    "cfg",
    [CFG, POST, TIED, VALUES],
    ids=["pre-norm", "post-norm", "tied", "value-residual-and-embeddings"],
)
def test_cached_decode_logits_equal_full_recompute_at_every_position(cfg) -> None:
    full, decode, init_cache = _jitted(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, S), 0, cfg.vocab_size)
    expected = np.asarray(full(tokens))
    # Prefill the first 5 tokens, then one token per step up to the last position of the table.
    logits, cache = decode(tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), init_cache(2))
    np.testing.assert_allclose(logits, expected[:, :5], atol=1e-5)
    for p in range(5, S):
        logits, cache = decode(tokens[:, p : p + 1], jnp.full((2, 1), p), cache)
        np.testing.assert_allclose(logits[:, 0], expected[:, p], atol=1e-5, err_msg=f"position {p}")


def test_rows_at_different_positions_and_stale_slots_are_masked() -> None:
    full, decode, init_cache = _jitted(CFG)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, 280)
    expected = np.asarray(full(tokens))
    # Row 0 prefills 3 real tokens, row 1 all 8; row 0 carries junk in the rest of the 8-slot prefill.
    junk = tokens[:, :8].at[0, 3:].set(7)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    last, cache = decode(junk, positions, init_cache(2), out_index_B=jnp.array([2, 7]))
    assert last.shape == (2, 1, CFG.padded_vocab)
    np.testing.assert_allclose(last[:, 0], expected[[0, 1], [2, 7]], atol=1e-5)
    pos = jnp.array([3, 8])
    for _ in range(4):  # each row continues from its own position; row 0 overwrites its junk slots
        logits, cache = decode(tokens[jnp.arange(2), pos][:, None], pos[:, None], cache)
        np.testing.assert_allclose(logits[:, 0], expected[[0, 1], pos], atol=1e-5)
        pos = pos + 1


def test_bfloat16_cache_is_in_the_compute_dtype_and_close_to_float32() -> None:
    _, decode, init_cache = _jitted(dataclasses.replace(CFG, dtype="bfloat16"))
    cache = init_cache(1)
    assert cache[0][0].dtype == jnp.bfloat16 and cache[0][0].shape == (1, 4, S, 8)
    tokens = jnp.arange(6)[None]
    logits, cache = decode(tokens, jnp.arange(6)[None], cache)
    assert logits.dtype == jnp.float32 and cache[0][0].dtype == jnp.bfloat16
    ref = _jitted(CFG)[0](tokens)
    np.testing.assert_allclose(logits[..., :280], ref[..., :280], atol=0.05)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_decoding_reads_bfloat16_kernels_and_computes_the_same(scan: bool) -> None:
    """A bfloat16 model decodes from its projections' kernels cast once (`decoding_params`): every product cast
    them anyway, so the logits are the same bit for bit, while the decode program, which converted each
    layer's float32 kernels at every step, converts none. Norms, biases and embeddings stay float32."""
    cfg = dataclasses.replace(CFG, dtype="bfloat16", scan_layers=scan, bias=True)
    graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
    cast = decoding_params(params, cfg)
    dtypes = {jax.tree_util.keystr(k): v.dtype for k, v in jax.tree_util.tree_leaves_with_path(cast)}
    assert {d for k, d in dtypes.items() if "kernel" in k} == {jnp.dtype(jnp.bfloat16)}
    assert {d for k, d in dtypes.items() if "kernel" not in k} == {jnp.dtype(jnp.float32)}, dtypes

    def step(p, tokens, positions, cache):
        return nnx.merge(graphdef, p).decode(tokens, positions, cache)

    tokens, positions = jnp.arange(6)[None], jnp.arange(6)[None]
    cache = nnx.merge(graphdef, params).init_cache(1)
    kernels = {
        k.shape[-2:] for path, k in jax.tree_util.tree_leaves_with_path(params) if "kernel" in str(path)
    }
    for p in (params, cast):
        program = jax.jit(step).lower(p, tokens, positions, cache).as_text()
        converted = re.findall(r"tensor<([\dx]+)xf32>\) -> tensor<[\dx]+xbf16>", program)
        kernels_converted = {tuple(int(n) for n in c.split("x")[-2:]) for c in converted} & kernels
        assert kernels_converted == (kernels if p is params else set()), converted
    np.testing.assert_array_equal(
        jax.jit(step)(cast, tokens, positions, cache)[0], step(params, tokens, positions, cache)[0]
    )


def test_greedy_and_sampled_tokens_identical_with_and_without_the_cache(setup) -> None:
    graphdef, params, tok = setup
    prompt = tok.encode("the cat sat")
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 50, "num_samples": 2}):
        cached = generate_ids(graphdef, params, prompt, **_ids_kw(**kw))
        assert cached == generate_ids_full_recompute(graphdef, params, prompt, **_ids_kw(**kw))
        assert all(len(s) == S - len(prompt) for s in cached)


def test_batched_prompts_of_different_lengths_equal_one_by_one_runs(setup) -> None:
    graphdef, params, tok = setup
    prompts = [tok.encode("the"), tok.encode("the cat sat on the mat and"), [], tok.encode("dog ran")]
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "num_samples": 2}):
        batch = generate_ids_batch(graphdef, params, prompts, **_ids_kw(**kw))
        one_by_one = [generate_ids(graphdef, params, p, **_ids_kw(**kw)) for p in prompts]
        assert batch == one_by_one
        # every row runs to the end of its own context
        assert [len(s[0]) for s in batch] == [S - max(len(p), 1) for p in prompts]
    texts = generate_batch(graphdef, params, tok, ["the", "dog ran"], **_text_kw(max_new_tokens=5))
    assert texts == [_gen(setup, p, max_new_tokens=5, temperature=1.0) for p in ("the", "dog ran")]


def test_one_compilation_for_any_prompt_length_and_token_count_in_a_bucket(setup) -> None:
    graphdef, params, _ = setup
    before = _generate_cached._cache_size()
    for prompt, n in (([5, 6], 3), ([5, 6, 7, 8, 9], 7), (list(range(1, 16)), 30)):
        # settings no other test uses: a fresh cache entry, whatever the prompt's length and token budget
        generate_ids(graphdef, params, prompt, **_ids_kw(temperature=0.7, top_k=3, max_new_tokens=n))
    assert _generate_cached._cache_size() == before + 1
    assert [prompt_bucket(n, 256) for n in (1, 16, 17, 100, 200)] == [16, 16, 32, 128, 256]
    assert prompt_bucket(23, S) == S  # never longer than the position table


# ---- sampling ----


def test_greedy_is_deterministic_and_seeds_control_sampling(setup) -> None:
    assert _gen(setup, temperature=0.0) == _gen(setup, temperature=0.0, seed=9)
    a = _gen(setup, temperature=1.0, num_samples=4)
    assert a == _gen(setup, temperature=1.0, num_samples=4)
    assert a != _gen(setup, temperature=1.0, num_samples=4, seed=1)
    assert _gen(setup, num_samples=4, seed=1) == _gen(setup, num_samples=4, key=jax.random.PRNGKey(1))
    assert len(set(a)) > 1  # samples in one batch differ too
    assert all(t.startswith("the cat") for t in a)
    p = _gen(setup, temperature=1.0, top_p=0.9, num_samples=2)
    assert p == _gen(setup, temperature=1.0, top_p=0.9, num_samples=2)
    assert p != _gen(setup, temperature=1.0, top_p=0.9, num_samples=2, seed=1)


PROBS = np.array([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])


def _draws(top_k: int, top_p: float, n: int = 2000) -> np.ndarray:
    logits = jnp.log(jnp.asarray(PROBS))[None]
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    return np.asarray(jax.vmap(lambda k: sample_logits(logits, k, 1.0, top_k, top_p))(keys))[:, 0]


def test_top_k_samples_only_from_the_k_most_likely() -> None:
    draws = _draws(top_k=3, top_p=1.0)
    assert set(draws.tolist()) == {1, 3, 4}
    # within the set, frequencies follow the renormalised probabilities 0.3 : 0.25 : 0.2
    freq = np.bincount(draws, minlength=6)[[1, 3, 4]] / len(draws)
    np.testing.assert_allclose(freq, np.array([0.3, 0.25, 0.2]) / 0.75, atol=0.04)


@pytest.mark.parametrize(
    ("top_k", "top_p", "allowed"),
    [
        (0, 0.6, [1, 3, 4]),  # 0.3 + 0.25 = 0.55 < 0.6, so the third most likely is needed too
        (0, 0.5, [1, 3]),  # 0.3 < 0.5 <= 0.55
        (0, 0.01, [1]),  # the most likely token is always kept
        (2, 0.9, [1, 3]),  # top-k first, then the nucleus of what is left
        (0, 1.0, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_top_p_samples_only_from_the_nucleus(top_k: int, top_p: float, allowed: list[int]) -> None:
    draws = _draws(top_k, top_p)
    assert set(draws.tolist()) == set(allowed)
    freq = np.bincount(draws, minlength=6)[allowed] / len(draws)
    np.testing.assert_allclose(freq, PROBS[allowed] / PROBS[allowed].sum(), atol=0.04)


def test_temperature_zero_is_argmax_whatever_the_filters() -> None:
    logits = jnp.log(jnp.asarray(PROBS))[None]
    assert int(sample_logits(logits, jax.random.PRNGKey(0), 0.0, 2, 0.3)[0]) == 1


# ---- limits and errors ----


def test_prompt_longer_than_the_context_and_bad_values_are_refused(setup) -> None:
    with pytest.raises(ConfigError, match="the model's context is 24"):
        _gen(setup, prompt="the cat sat on the mat " * 10)
    graphdef, params, _ = setup
    with pytest.raises(ConfigError, match=r"^prompt 2 is 24 tokens; the model's context is 24"):
        generate_ids_batch(graphdef, params, [[1], [2] * S], **_ids_kw())
    bad = {
        "temperature must be >= 0": {"temperature": -1.0},
        "top_k must be >= 0": {"top_k": -1},
        r"top_p must be in \(0, 1\]": {"top_p": 0.0},
        r"top_p must be in \(0, 1\] \(1: all tokens\), got 1.5": {"top_p": 1.5},
        "max_new_tokens must be >= 0": {"max_new_tokens": -1},
        "num_samples must be >= 1": {"num_samples": 0},
    }
    for message, kw in bad.items():
        with pytest.raises(ConfigError, match=message) as exc:
            _gen(setup, **kw)
        assert "\n" not in str(exc.value)


def test_empty_prompt_starts_a_new_document_from_end_of_text(setup) -> None:
    graphdef, params, tok = setup
    kw = _ids_kw(eot_id=tok.eot_id, temperature=0.0, max_new_tokens=5)
    from_eot = generate_ids(graphdef, params, [tok.eot_id], **kw)
    assert generate_ids(graphdef, params, [], **kw) == from_eot
    assert _gen(setup, prompt="", temperature=0.0, max_new_tokens=5) == [tok.decode(from_eot[0])]


def test_generation_stops_at_the_context_end(setup) -> None:
    graphdef, params, tok = setup
    prompt = tok.encode("the cat sat on the mat and the dog")
    (new,) = generate_ids(graphdef, params, prompt, **_ids_kw(max_new_tokens=100))
    assert len(new) == S - len(prompt)  # never past the position table
    (short,) = generate_ids(graphdef, params, prompt, **_ids_kw(max_new_tokens=3))
    assert len(short) == 3
    assert generate_ids(graphdef, params, [3] * (S - 1), **_ids_kw(max_new_tokens=100))[0].__len__() == 1
    assert generate_ids(graphdef, params, prompt, **_ids_kw(max_new_tokens=0)) == [[]]


def test_sampling_stops_at_end_of_text(setup) -> None:
    graphdef, params, tok = setup
    # Make end-of-text the model's certain choice by biasing the output layer toward it.
    biased = jax.tree.map(lambda x: x, params)
    biased["lm_head"]["bias"][...] = biased["lm_head"]["bias"][...].at[tok.eot_id].set(1e4)
    kw = _ids_kw(eot_id=tok.eot_id, max_new_tokens=10)
    assert generate_ids(graphdef, biased, tok.encode("the"), **kw) == [[]]


def test_each_row_stops_at_its_own_end_of_text(setup) -> None:
    graphdef, params, _ = setup
    prompts = [[5, 6, 7], [9]]
    free = generate_ids_batch(graphdef, params, prompts, **_ids_kw(temperature=0.0))
    a, b = free[0][0], free[1][0]
    stop = next(t for t in a[2:] if t not in b)  # a token row 0 makes (not at once) and row 1 never does
    stopped = generate_ids_batch(graphdef, params, prompts, **_ids_kw(temperature=0.0, eot_id=stop))
    assert stopped == [[a[: a.index(stop)]], [b]]


def test_generation_stops_at_any_stop_token_as_a_chat_models_end_of_turn(setup) -> None:
    """A chat model ends its turn with a token of its own (<|im_end|>): every stop id ends a row, not only
    end-of-text, whichever comes first."""
    graphdef, params, _ = setup
    free = generate_ids(graphdef, params, [5, 6, 7], **_ids_kw(temperature=0.0))[0]
    first, later = free[3], next(t for t in free[4:] if t not in free[:4])
    kw = _ids_kw(temperature=0.0, stop_ids=(later, first))
    assert generate_ids(graphdef, params, [5, 6, 7], **kw) == [free[: free.index(first)]]
    assert generate_ids(graphdef, params, [5, 6, 7], **_ids_kw(temperature=0.0, stop_ids=(later,))) == [
        free[: free.index(later)]
    ]


# ---- streaming ----


def test_streaming_reports_every_new_token_in_order_and_prints_the_final_text(setup) -> None:
    graphdef, params, tok = setup
    seen = []
    kw = _ids_kw(temperature=1.0, num_samples=2, max_new_tokens=6)
    out = generate_ids(graphdef, params, [5, 6], on_token=lambda t, a: seen.append((t, a)), **kw)
    assert out == generate_ids(graphdef, params, [5, 6], **kw)
    for row in range(2):
        assert [int(t[row]) for t, a in seen if a[row]] == out[row]

    buf = io.StringIO()
    streamer = TextStreamer(tok, "the cat", file=buf)
    texts = _gen(setup, temperature=1.0, on_token=streamer)
    assert buf.getvalue().startswith("the cat") and len(buf.getvalue()) > len("the cat")
    streamer.finish(texts[0])
    assert buf.getvalue() == texts[0] + "\n"
    # a finished row's token (end-of-text, or anything after it) is never printed
    quiet = TextStreamer(tok, "the", file=io.StringIO())
    quiet(np.array([tok.encode(" cat")[0]]), np.array([False]))
    assert quiet.ids == [] and quiet.file.getvalue() == "the"


def test_streamed_tokens_equal_one_call_across_chunk_boundaries(setup) -> None:
    graphdef, params, tok = setup
    prompts = [tok.encode("the cat"), tok.encode("the dog ran far"), []]
    eot = generate_ids_batch(graphdef, params, prompts, **_ids_kw())[0][0][9]  # ends rows at different steps
    steps = []
    for n in (STREAM_CHUNK - 1, STREAM_CHUNK, STREAM_CHUNK + 3, 2 * STREAM_CHUNK + 5):
        kw = _ids_kw(eot_id=eot, num_samples=2, max_new_tokens=n)
        steps.clear()
        streamed = generate_ids_batch(
            graphdef, params, prompts, on_token=lambda t, a: steps.append((t, a)), **kw
        )
        assert streamed == generate_ids_batch(graphdef, params, prompts, **kw)
        rows = [s for p in streamed for s in p]
        for b, row in enumerate(rows):
            assert [int(t[b]) for t, a in steps if a[b]] == row
        assert max(map(len, rows)) <= len(steps) <= max(map(len, rows)) + 1  # + the step that ends the last
    assert len({len(r) for r in rows}) > 1


def _has_host_callback(lowered) -> bool:
    return "callback" in lowered.as_text()


def test_streamed_programs_have_no_host_callback(setup) -> None:
    # JAX's persistent compilation cache never stores a program that calls back into Python.
    graphdef, params, _ = setup
    assert _has_host_callback(jax.jit(lambda x: io_callback(np.sin, x, x)).lower(1.0))
    args = (np.ones((2, 16), np.int32), np.array([3, 5], np.int32), np.array([9, 9], np.int32))
    args += (jax.random.PRNGKey(0), np.arange(2, dtype=np.int32))
    assert not _has_host_callback(_prefill.lower(graphdef, params, *args))
    carry, row_keys_B = _prefill(graphdef, params, *args)
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "steps": STREAM_CHUNK}
    chunk = _decode_chunk.lower(graphdef, params, carry, row_keys_B, *args[1:3], np.int32(-1), **sampling)
    assert not _has_host_callback(chunk)


MULTI_DEVICE_STREAM = """
import jax
from flax import nnx
from minigpt.config import ModelConfig
from minigpt.inference.generate import SamplingConfig, generate_ids
from minigpt.nn.model import GPT, decoding_params
cfg = ModelConfig(vocab_size=280, max_seq_len=24, d_model=32, n_layers=1, n_heads=4, d_ff=64)
graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
mesh = jax.sharding.Mesh(jax.devices(), ("data",))
params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
seen = []
kw = dict(eot_id=-1, max_seq_len=24, sampling=SamplingConfig(max_new_tokens=5, temperature=0.0))
out = generate_ids(graphdef, params, [1, 2], on_token=lambda t, a: seen.append(int(t[0])), **kw)
print(len(jax.devices()), out[0] == seen, len(seen))
"""


def test_streaming_works_with_parameters_on_several_devices() -> None:
    # `minigpt generate` replicates parameters over every device; ordered host callbacks would refuse that.
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_BACKEND_FLAGS}"}
    out = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE_STREAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2", "True", "5"]


# ---- per-document masking of packed sequences (the training path) ----


def test_segment_ids_keep_packed_documents_apart() -> None:
    graphdef, params = nnx.split(GPT(CFG, nnx.Rngs(0)))
    forward = jax.jit(lambda t, segment_ids: nnx.merge(graphdef, params)(t, segment_ids=segment_ids))

    def model(tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """The model's logits, compiled (op by op, its calls here took most of this test's time)."""
        return forward(tokens, segment_ids)

    tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 16), 0, 280)
    segments = jnp.array([[0] * 6 + [1] * 10])
    other_first_doc = tokens.at[:, :6].set((tokens[:, :6] + 11) % 280)
    masked, masked2 = model(tokens, segment_ids=segments), model(other_first_doc, segment_ids=segments)
    # document 2 does not see document 1 ...
    np.testing.assert_allclose(masked[:, 6:], masked2[:, 6:], atol=1e-6)
    # ... which it does without segment ids
    assert not np.allclose(model(tokens)[:, 6:], model(other_first_doc)[:, 6:], atol=1e-3)
    # document 1 (at positions 0..5, as alone) gives the same logits as running it alone
    np.testing.assert_allclose(masked[:, :6], model(tokens[:, :6]), atol=1e-5)
    # one segment is the plain causal model
    np.testing.assert_allclose(model(tokens, segment_ids=jnp.zeros_like(tokens)), model(tokens), atol=1e-6)
    # and causality still holds inside a segment
    later = tokens.at[:, 12:].set((tokens[:, 12:] + 5) % 280)
    np.testing.assert_allclose(model(later, segment_ids=segments)[:, :12], masked[:, :12], atol=1e-6)


# ---- the command line ----


def test_cli_refuses_bad_sampling_flags_before_loading_anything(capsys, tmp_path) -> None:
    from minigpt.cli import main

    for flags, message in (
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-k", "-3"], "top_k must be >= 0"),
        (["--prompt-file", str(tmp_path / "missing.txt")], "cannot read --prompt-file"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["generate", "--run", str(tmp_path / "no-run"), *flags])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("minigpt: error: ") and message in err and "\n" not in err, err


def test_cli_prompts_prompt_file_and_streaming(setup, monkeypatch, capsys, tmp_path) -> None:
    import minigpt.training.runs
    from minigpt.cli import main

    graphdef, params, tok = setup
    fake_setup = types.SimpleNamespace(graphdef=graphdef, cfg=types.SimpleNamespace(model=CFG))
    monkeypatch.setattr(minigpt.training.runs, "load_model", lambda *a, **k: (fake_setup, params, tok, 0))
    (tmp_path / "p.txt").write_text("the dog\n")
    common = ["generate", "--run", "r", "--max-new-tokens", "6", "--seed", "3"]

    main([*common, "--prompt", "the cat", "--prompt", "", "--prompt-file", str(tmp_path / "p.txt")])
    out = capsys.readouterr().out
    kw = _text_kw(max_new_tokens=6, seed=3, temperature=0.8, top_k=40)
    expected = generate_batch(graphdef, params, tok, ["the cat", "", "the dog"], **kw)
    assert out == "".join(f"--- prompt {i + 1}\n{t[0]}\n" for i, t in enumerate(expected))

    main([*common, "--prompt", "the cat"])  # streamed
    streamed = capsys.readouterr().out
    main([*common, "--prompt", "the cat", "--no-stream"])
    assert streamed == capsys.readouterr().out == expected[0][0] + "\n"
