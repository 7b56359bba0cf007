"""A conversation with a chat model: each turn rendered by its chat template, the reply sampled until one of
its stop tokens (its end-of-turn), and the key/value cache carried from turn to turn, so a turn costs the
model only its new tokens rather than the whole conversation again.

The cache holds the tokens in `Conversation.ids` up to `valid`. A turn renders the whole conversation and
feeds the model only the text after what the cache already holds; where the template renders the past
differently (some drop earlier turns' reasoning), the conversation is read again from its start. Sampling a
reply writes the stop token's keys over the last reply token's slot (a finished row's steps are clamped,
see `generate`), so that token is fed again with the next turn.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minigpt.config import ConfigError
from minigpt.inference.generate import STREAM_CHUNK, SamplingConfig, _decode_chunk, _row_keys, prompt_bucket
from minigpt.runtime import interrupts


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _extend(
    graphdef: nnx.GraphDef, params: Any, cache: Any, ids_1P: jax.Array, start: jax.Array, n: jax.Array
):
    """Feed tokens ids_1P[:, :n] at positions start.. into the cache (the rest is padding, whose slots later
    tokens overwrite); the next-token logits after the last of them (1, V) and the cache."""
    model = nnx.merge(graphdef, params)
    positions_1P = start + jnp.arange(ids_1P.shape[1])[None]
    logits_11V, cache = model.decode(ids_1P, positions_1P, cache, out_index_B=jnp.reshape(n - 1, (1,)))
    return logits_11V[:, 0], cache


class Conversation:
    """A chat with a model: the messages so far and the cache of the tokens it has read."""

    def __init__(
        self, setup: Any, params: Any, tokenizer: Any, sampling: SamplingConfig, system: str = ""
    ) -> None:
        if not hasattr(tokenizer, "chat_template"):
            raise ConfigError(
                "this run's tokenizer has no chat template or special tokens; chat needs a chat model's "
                "(a transformers checkpoint trained or imported with its own tokenizer)"
            )
        self.graphdef, self.params, self.tokenizer, self.sampling = (
            setup.graphdef,
            params,
            tokenizer,
            sampling,
        )
        self.template, self.max_seq_len = tokenizer.chat_template(), setup.cfg.model.max_seq_len
        self.messages = [{"role": "system", "content": system}] if system else []
        self.ids: list[int] = []
        self.text, self.valid, self.turns = "", 0, 0
        self.cache = nnx.merge(self.graphdef, params).init_cache(1)

    def say(self, text: str, on_text: Callable[[str], None] | None = None) -> str:
        """The model's reply to the user's `text`, streamed to `on_text` piece by piece as it is sampled."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.template.render(messages, add_generation_prompt=True).text
        if prompt.startswith(self.text):
            ids = self.ids + self.tokenizer.encode_chat(prompt[len(self.text) :])
        else:  # the template renders the past otherwise: read it all again
            ids, self.valid = self.tokenizer.encode_chat(prompt), 0
        if len(ids) >= self.max_seq_len:
            raise ConfigError(
                f"the conversation is {len(ids)} tokens, the model's context {self.max_seq_len}: start a new one"
            )
        logits = self._feed(ids)
        reply, stop, shown = self._sample(logits, len(ids), on_text)
        answer = self.tokenizer.decode(reply)
        if on_text is not None and answer.startswith(shown) and len(answer) > len(shown):
            on_text(answer[len(shown) :])  # what streaming held back: an incomplete character at the end
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        self.ids = ids + reply + ([] if stop is None else [stop])
        self.valid = len(ids) + len(reply) - (stop is not None)
        self.text = prompt + self.tokenizer.decode(self.ids[len(ids) :])
        self.turns += 1
        return self.messages[-1]["content"]

    def _feed(self, ids: list[int]) -> jax.Array:
        """Feed the tokens the cache does not hold yet; the next-token logits after the last one."""
        new = ids[self.valid :]
        P = prompt_bucket(len(new), self.max_seq_len)
        chunk = np.zeros((1, P), np.int32)
        chunk[0, : len(new)] = new
        logits, self.cache = _extend(
            self.graphdef, self.params, self.cache, chunk, np.int32(self.valid), np.int32(len(new))
        )
        self.valid = len(ids)
        return logits

    def _sample(
        self, logits: jax.Array, length: int, on_text: Callable[[str], None] | None
    ) -> tuple[list[int], int | None, str]:
        """The reply's tokens, the stop token that ended it (None: the token budget or the context did), and
        the text streamed to `on_text`."""
        s = self.sampling
        budget = np.array([min(s.max_new_tokens, self.max_seq_len - length)], np.int32)
        carry = (jnp.int32(0), logits, self.cache, jnp.zeros((1,), jnp.int32), jnp.asarray(budget <= 0))
        keys = _row_keys(jax.random.PRNGKey(s.seed + self.turns), np.zeros((1,), np.int32))
        stops = np.array(self.tokenizer.stop_ids, np.int32)
        sampling = dict(temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p))
        reply, stop, shown, more = [], None, "", True
        while more and stop is None and not interrupts.requested():
            carry, tokens_K1, active_K1, n, more = _decode_chunk(
                self.graphdef, self.params, carry, keys, np.array([length], np.int32), budget, stops,
                steps=STREAM_CHUNK, **sampling,
            )  # fmt: skip
            tokens_K1, active_K1, n, more = jax.device_get((tokens_K1, active_K1, n, more))
            for k in range(n):
                if not active_K1[k, 0]:
                    stop = int(tokens_K1[k, 0]) if len(reply) < budget[0] else None
                    break
                reply.append(int(tokens_K1[k, 0]))
            shown = _stream(self.tokenizer.decode(reply), shown, on_text)
        self.cache = carry[2]
        return reply, stop, shown


def _stream(text: str, shown: str, on_text: Callable[[str], None] | None) -> str:
    """Hand `on_text` what `text` adds to what was shown, holding back an incomplete UTF-8 character."""
    if on_text is None or not text.startswith(shown) or text.endswith("\ufffd"):
        return shown
    if len(text) > len(shown):
        on_text(text[len(shown) :])
    return text
