"""Conversations as a chat model reads them: rendered by its own chat template, as transformers renders one.

A chat template is a jinja2 program (chat_template.jinja, or tokenizer_config.json's "chat_template") that
turns a list of messages (role, content) into the text the model was trained on. It runs here in jinja2's
immutable sandbox, within bounds of steps and size (`minigpt.data.sandbox`: templates are code from the
internet), with what transformers gives it: `messages`, `add_generation_prompt`, the tokenizer's `bos_token`
and `eos_token`, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML. A template's
`{% generation %}` blocks mark the text the assistant wrote; `Rendered.assistant` keeps their character
spans, found by markers made afresh for each render so that no text in a conversation can forge them. A
model without a template of its own is given ChatML's.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import re
import secrets
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from minigpt.config import ConfigError
from minigpt.data import sandbox

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{{ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The template of a model whose tokenizer names none: ChatML, the format of Qwen and SmolLM2's chat models."""

ROLES = ("system", "user", "assistant")
RENDERING = 2
"""How conversations become examples (markers, bounds): part of a store of examples' identity, so a store
rendered by an older way is rendered again."""


@dataclasses.dataclass(frozen=True)
class Rendered:
    text: str
    assistant: tuple[tuple[int, int], ...]
    """Character spans of `text` inside the template's {% generation %} blocks (none without such blocks)."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template, the special tokens it may name, and where it came from (`origin`, for errors)."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    origin: str = "the chat template"

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> Rendered:
        """The conversation as the model reads it; with `add_generation_prompt`, followed by the start of
        the assistant's turn. A template that fails, or goes past its bounds (`sandbox`), says so in one
        line naming it."""
        check_messages(messages)
        bos, eos = self.bos_token or "", self.eos_token or ""
        inputs = [self.source, bos, eos, *(m["content"] for m in messages)]
        budget = sandbox.Budget.for_input(len(messages), sum(map(len, inputs)), _marks(inputs))
        template = _compile(self.source, self.origin)
        try:
            with sandbox.bounded(budget):
                raw = _output(template.generate(
                    messages=list(messages), add_generation_prompt=add_generation_prompt,
                    bos_token=bos, eos_token=eos,
                ))  # fmt: skip
        except sandbox.Exceeded as e:
            raise ConfigError(self._exceeded(e, messages)) from None
        except Exception as e:  # jinja2's errors and the template's own raise_exception
            why = str(e).strip() or type(e).__name__
            raise ConfigError(f"the chat template failed: {why} ({self.origin})") from None
        return _spans(raw, budget.marks)

    def identity(self) -> dict[str, Any]:
        """All that decides the tokens of a conversation besides the tokenizer: the template (its generation
        blocks too), the special tokens it is given, and the way of rendering (`RENDERING`)."""
        digest = hashlib.sha256(self.source.encode()).hexdigest()
        return {"template": digest, "bos": self.bos_token, "eos": self.eos_token, "rendering": RENDERING}

    def _exceeded(self, e: sandbox.Exceeded, messages: Sequence[dict[str, Any]]) -> str:
        what = "ran more than" if e.what == "steps" else "made a text of more than"
        return (
            f"{self.origin} {what} {e.limit:,} {e.what} rendering one conversation of {len(messages)} "
            "messages, far past what any chat template needs (a loop without end, text repeated many times?); "
            "minigpt stops it there: fix that template or use another"
        )


def _output(pieces: Iterator[str]) -> str:
    """A render's output, which may not pass the budget's characters either."""
    out, n, limit = [], 0, sandbox.current().chars  # type: ignore[union-attr]
    for piece in pieces:
        n += len(piece)
        if n > limit:
            raise sandbox.Exceeded("characters", limit)
        out.append(piece)
    return "".join(out)


def _marks(inputs: Sequence[str]) -> tuple[str, str]:
    """Markers around a generation block's text while rendering that occur in none of the inputs (the
    template, its special tokens, the messages), so no text can open or close a block."""
    while True:
        nonce = secrets.token_hex(8)
        marks = (f"\ue000{nonce}\ue001", f"\ue001{nonce}\ue000")
        if not any(m in text for text in inputs for m in marks):
            return marks


def check_messages(messages: Sequence[Any]) -> None:
    """Refuse what is not a conversation: each message a {"role", "content"} with a known role and text."""
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ConfigError(
                f"message {i + 1} is not a {{'role': {' | '.join(ROLES)}, 'content': text}}: {str(m)[:80]}"
            )


def _spans(raw: str, marks: tuple[str, str]) -> Rendered:
    """The text without the generation markers, and where the marked parts are in it."""
    if marks[0] not in raw:
        return Rendered(raw, ())
    text, spans, length, depth, opened, at = [], [], 0, 0, 0, 0
    while True:
        found = [(j, m) for m in marks if (j := raw.find(m, at)) >= 0]
        if not found:
            text.append(raw[at:])
            return Rendered("".join(text), tuple(spans))
        j, mark = min(found)
        text.append(raw[at:j])
        length += j - at
        if mark == marks[0]:
            depth, opened = depth + 1, length if depth == 0 else opened
        else:
            depth -= 1
            if depth == 0 and length > opened:
                spans.append((opened, length))
        at = j + len(mark)


@functools.cache
def _compile(source: str, origin: str) -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: text the assistant wrote, marked for `_spans`."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            marks = sandbox.current().marks  # type: ignore[union-attr]
            return marks[0] + caller() + marks[1]

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = sandbox.BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    )
    env.bound_filters()
    env.globals.update(
        raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt)
    )
    try:
        with sandbox.bounded(
            sandbox.Budget.for_input(0, len(source))
        ):  # it folds constants: `'x'|center(10**9)`
            return env.bounded_template(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(
            f"the chat template is not valid jinja2 (line {e.lineno}: {e.message}; {origin})"
        ) from None


@dataclasses.dataclass(frozen=True)
class Example:
    """One training or evaluation example: its tokens, and which of them the assistant wrote (the targets
    its loss is taken on)."""

    ids: list[int]
    assistant: list[bool]


class ExampleRecord(str):
    """A conversation or prompt/completion record, as its JSON text: one training example, which the chat
    template renders and which is never cut into pieces."""


def example_record(record: Any, where: str) -> ExampleRecord:
    """A record of a file of conversations, checked (`where` names it in errors): its messages (or prompt and
    completion) alone."""
    if not is_conversation(record):
        raise ConfigError(
            f'{where} is not a conversation (no "messages", or "prompt" and "completion"), but the '
            "file's first record is: a file holds conversations or text, not both"
        )
    try:
        check_example(record)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    keys = ("messages",) if "messages" in record else ("prompt", "completion")
    return ExampleRecord(json.dumps({k: record[k] for k in keys}))


def is_conversation(record: Any) -> bool:
    """Whether a JSON record is a conversation (`messages`) or a prompt/completion pair, as TRL reads them."""
    return isinstance(record, dict) and ("messages" in record or {"prompt", "completion"} <= record.keys())


def check_example(record: dict[str, Any]) -> None:
    """Refuse a record that is no example: messages that are not a non-empty conversation, a prompt and a
    completion that are not both texts or both lists of messages."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError('"messages" must be a non-empty list of {"role", "content"} messages')
        check_messages(messages)
        return
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        check_messages([*prompt, *completion])
    elif not (isinstance(prompt, str) and isinstance(completion, str)):
        raise ConfigError("a prompt/completion record holds two texts, or two lists of messages")


def example_tokens(record: dict[str, Any], template: ChatTemplate, tokenizer: Any) -> Example:
    """A record's tokens through the chat template, the assistant's marked: in a conversation each assistant
    message as the template writes it (its {% generation %} blocks, or, without them, the text rendering
    the message adds after the assistant's turn is opened); of a prompt/completion pair, the completion
    (prompt and completion given as messages are rendered too; as text, the completion ends with the
    end-of-text, after the tokenizer's BOS, as TRL's SFTTrainer tokenizes them)."""
    check_example(record)
    if "messages" in record:
        text, spans = _assistant_spans(template, record["messages"])
    elif isinstance(record["prompt"], list):
        prompt = template.render(record["prompt"], add_generation_prompt=True).text
        text = template.render([*record["prompt"], *record["completion"]]).text
        if not text.startswith(prompt):
            raise ConfigError("the chat template writes the prompt differently once the completion follows")
        spans = ((len(prompt), len(text)),)
    else:
        bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        prompt = bos + tokenizer.encode_chat(record["prompt"])
        both = tokenizer.encode_chat(record["prompt"] + record["completion"])
        tokenizer.check_rendered(record["prompt"] + record["completion"], both)
        ids = bos + both + [tokenizer.eot_id]
        return Example(ids, [i >= len(prompt) for i in range(len(ids))])
    ids, offsets = tokenizer.encode_chat(text, offsets=True)
    tokenizer.check_rendered(text, ids)  # bits per byte count the assistant's text by its tokens
    return Example(ids, [any(a <= start < b for a, b in spans) for start, _ in offsets])


def _assistant_spans(template: ChatTemplate, messages: list) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The rendered conversation and the spans of it the assistant wrote."""
    full = template.render(messages)
    if re.search(r"{%-?\s*generation\s*-?%}", template.source):
        return full.text, full.assistant
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True).text
        after = template.render(messages[: i + 1]).text
        if not (after.startswith(before) and full.text.startswith(after)):
            raise ConfigError(
                "the chat template writes earlier turns differently as the conversation goes on, so the "
                "assistant's text cannot be told apart; give it {% generation %} blocks around it"
            )
        spans.append((len(before), len(after)))
    return full.text, tuple(spans)


MARKS = ("\u27e6", "\u27e7")
"""Around the assistant's text where an example is shown: ⟦ and ⟧."""


def show_example(example: Example, tokenizer: Any) -> str:
    """The example's text with the assistant's tokens (its loss's targets) between MARKS."""
    out, start = [], 0
    for i in range(1, len(example.ids) + 1):
        if i == len(example.ids) or example.assistant[i] != example.assistant[start]:
            text = tokenizer.decode(example.ids[start:i])
            out.append(f"{MARKS[0]}{text}{MARKS[1]}" if example.assistant[start] else text)
            start = i
    return "".join(out)
