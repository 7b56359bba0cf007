"""The continuous-batching engine: requests that join a running batch get what `generate` gives them alone,
long prompts are read in chunks between decode steps, a cancelled request leaves within one step, the queue
has a limit, and the decode step compiles per batch bucket, not per request."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from minigpt.config import ConfigError
from minigpt.inference.engine import Engine, EngineConfig, QueueFull, Request, _decode_rows
from minigpt.inference.generate import SamplingConfig, generate_ids
from minigpt.training.runs import load_model


@pytest.fixture(scope="module")
def model(chat_run: Path):
    setup, params, tok, _ = load_model(chat_run)
    return setup.graphdef, params, tok, setup.cfg.model.max_seq_len


class Collector:
    """A request's on_tokens: its tokens, its finish reason, and hooks the tests hang on the stream."""

    def __init__(self, on_token=None, on_finish=None) -> None:
        self.tokens, self.reason, self.done, self.on_token = [], None, threading.Event(), on_token
        self.on_finish = on_finish

    def __call__(self, tokens: list[int], reason: str | None) -> None:
        self.tokens += tokens
        if tokens and self.on_token is not None:
            self.on_token(self)
        if reason is not None:
            self.reason = reason
            if self.on_finish is not None:
                self.on_finish(self)
            self.done.set()

    def wait(self) -> Collector:
        assert self.done.wait(300), "the engine did not finish the request"
        return self


def prompt(tok, words: int) -> list[int]:
    return tok.encode_chat(
        f"<|im_start|>user\n{'Tom saw a red ball. ' * words}<|im_end|>\n<|im_start|>assistant\n"
    )


def engine(model, **config) -> Engine:
    """An engine of 4 rows reading 16 prompt tokens per call: one cache shape, so the tests share programs."""
    graphdef, params, tok, max_seq_len = model
    config = EngineConfig(**{"slots": 4, "prefill_chunk": 16, **config})
    return Engine(graphdef, params, max_seq_len=max_seq_len, stop_ids=tok.stop_ids, config=config).start()


def alone(model, ids: list[int], budget: int, **sampling) -> list[int]:
    graphdef, params, tok, max_seq_len = model
    sampling = SamplingConfig(max_new_tokens=budget, **{"temperature": 0.0, "top_k": 0, **sampling})
    return generate_ids(graphdef, params, ids, sampling, eot_id=tok.eot_id, max_seq_len=max_seq_len,
                        stop_ids=tok.stop_ids)[0]  # fmt: skip


def test_requests_joining_a_running_batch_get_what_generate_gives_each_alone(model) -> None:
    """Greedy and sampled requests (own temperature and seed) join while another decodes, one prompt longer
    than a prefill chunk; each gets the tokens `generate` gives its prompt alone with the same settings."""
    tok = model[2]
    eng = engine(model)
    # Prompts of 24 to 30 tokens (two chunks each; one prompt bucket for `generate`).
    specs = [(prompt(tok, 1), 40, {}), (prompt(tok, 2), 12, {}), (prompt(tok, 1)[:-3] + prompt(tok, 2)[-8:], 12, {}),
             (prompt(tok, 2), 12, {"temperature": 1.0, "seed": 7})]  # fmt: skip
    joined = threading.Event()
    first = Collector(lambda c: len(c.tokens) == 3 and joined.set())
    eng.submit(Request(specs[0][0], specs[0][1], first, temperature=0.0))
    assert joined.wait(300)
    others = [Collector() for _ in specs[1:]]
    for (ids, budget, s), c in zip(specs[1:], others, strict=True):
        eng.submit(Request(ids, budget, c, temperature=s.get("temperature", 0.0), seed=s.get("seed", 0)))
    for (ids, budget, s), c in zip(specs, [first, *others], strict=True):
        assert c.wait().tokens == alone(model, ids, budget, **s)
        assert c.reason == ("length" if len(c.tokens) == budget else "stop")
    assert eng.load()["busy"] == 0
    eng.close()


def test_a_long_prompt_is_read_in_chunks_while_the_running_stream_keeps_decoding(model) -> None:
    tok = model[2]
    eng = engine(model)
    running = threading.Event()
    stream = Collector(lambda c: len(c.tokens) == 2 and running.set())
    eng.submit(Request(prompt(tok, 1), 100, stream, temperature=0.0))
    assert running.wait(300)
    long_ids = prompt(tok, 10)
    seen = []
    late = Collector(lambda c: len(c.tokens) == 1 and seen.append(len(stream.tokens)))
    before = len(stream.tokens)
    eng.submit(Request(long_ids, 2, late, temperature=0.0))
    late.wait()
    chunks = -(-len(long_ids) // 16)
    assert chunks >= 4 and seen[0] - before >= chunks - 1  # a decode step after every chunk but the last
    eng.cancel(Request([], 1, stream))  # any request but this one: nothing happens
    eng.close()


def test_a_cancelled_request_leaves_its_row_within_one_decode_step(model) -> None:
    tok = model[2]
    eng = engine(model)
    at: dict[str, int] = {}
    keep = Collector()
    eng.submit(Request(prompt(tok, 2), 100, keep, temperature=0.0))

    def cancel_at_fifth(c: Collector) -> None:
        if len(c.tokens) == 5:
            at["cancelled"] = eng.load()["steps"]
            eng.cancel(request)

    # The engine calls a request's hook from its own thread, before its next step: the step count then is
    # the one the row was freed at.
    gone = Collector(cancel_at_fifth, lambda c: at.setdefault("freed", eng.load()["steps"]))
    request = Request(prompt(tok, 1), 100, gone, temperature=0.0)
    eng.submit(request)
    gone.wait()
    assert gone.reason == "cancelled" and len(gone.tokens) == 5
    assert at["freed"] - at["cancelled"] <= 1
    load = eng.load()
    assert load["busy"] <= 1 and not keep.done.is_set()  # the other stream decodes on
    eng.close(0)
    assert keep.wait().reason == "shutdown"


def test_the_queue_is_bounded_and_a_closed_engine_refuses(model) -> None:
    tok = model[2]
    eng = engine(model, max_queue=1)
    started, hold = threading.Event(), threading.Event()
    busy = Collector(lambda c: (started.set(), hold.wait(300)))  # holds the engine in its hook
    eng.submit(Request(prompt(tok, 1), 100, busy, temperature=0.0))
    assert started.wait(300)  # admitted: the queue is empty again, and stays so while the hook holds
    queued = Collector()
    eng.submit(Request(prompt(tok, 1), 100, queued, temperature=0.0))
    with pytest.raises(QueueFull):
        eng.submit(Request(prompt(tok, 1), 100, Collector(), temperature=0.0))
    hold.set()
    eng.close(0)
    assert busy.wait().reason == "shutdown" and queued.reason in ("shutdown", "length")
    with pytest.raises(RuntimeError, match="shutting down"):
        eng.submit(Request(prompt(tok, 1), 1, Collector()))


def test_the_decode_step_is_compiled_per_batch_bucket_not_per_request(model) -> None:
    """Eight requests of other prompt lengths and budgets, in waves over the 4 rows, compile the decode step
    only for the batch sizes they reach (1, 2, 4) and the attention windows (64, 128 of the 128-token context)
    in one sampling mode, where the tests before have not yet."""
    tok = model[2]
    eng = engine(model)
    before = _decode_rows._cache_size()
    collectors = [Collector() for _ in range(8)]
    for i, c in enumerate(collectors):
        eng.submit(Request(prompt(tok, 1 + i), 3 + 2 * i, c, temperature=0.0))
    for c in collectors:
        c.wait()
    assert _decode_rows._cache_size() - before <= 3 * 2
    eng.close()


def test_impossible_settings_and_prompts_are_refused_in_one_line(model) -> None:
    with pytest.raises(ConfigError, match="power of two"):
        EngineConfig(prefill_chunk=100)
    with pytest.raises(ConfigError, match="slots must be >= 1"):
        EngineConfig(slots=0)
    eng = engine(model)
    with pytest.raises(ConfigError, match="the model's context is 128"):
        eng.submit(Request(list(range(128)), 1, Collector()))
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
        eng.submit(Request([1, 2], 0, Collector()))
    eng.close()
