"""jinja2's immutable sandbox with bounds, for chat templates: code from the internet, run on every example.

The sandbox stops a template from reaching Python's internals; it does not stop one from running forever
(nested `range(100000)` loops) or writing gigabytes (`m['content'] * 1000000`). Here every render has a
budget: a number of steps (each loop turn and each call counts one: without them a template does a bounded
amount of work) and a number of characters that no string it makes, nor its output, may pass. Both grow with the conversation, so any real
template renders well within them, and counting steps rather than seconds gives the same answer on a busy
machine. A template past either bound raises `Exceeded`.

Operators and calls that would build a string or list past the bound are refused before they run (`'x' *
10**9` never allocates), and what they take and return is checked. Loops get their steps by wrapping each `for`'s
iterable, and `~` by replacing it with a checked join, in the template's syntax tree before it compiles.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_STEPS = 1_000_000
"""Steps every render may take, plus STEPS_PER_MESSAGE per message."""
STEPS_PER_MESSAGE = 1_000
MAX_CHARS = 1 << 20
"""Characters any string a render makes may hold, plus CHARS_PER_INPUT_CHAR per character of its input."""
CHARS_PER_INPUT_CHAR = 8
_MAX_POWER_BITS = 1 << 16  # `**` of integers: a larger result is arithmetic no chat template needs


class Exceeded(Exception):
    """A render went past its bounds: `what` says which ("steps" or "characters"), `limit` how many."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"more than {limit:,} {what}")
        self.what, self.limit = what, limit


@dataclasses.dataclass
class Budget:
    """One render's bounds: steps left, the longest string allowed, and the state of whoever renders
    (`marks`: the generation blocks' markers of `minigpt.data.chat`)."""

    steps: int
    chars: int
    marks: tuple[str, str] = ("", "")
    limit: int = 0

    @classmethod
    def for_input(cls, messages: int, input_chars: int, marks: tuple[str, str] = ("", "")) -> Budget:
        steps = MAX_STEPS + STEPS_PER_MESSAGE * messages
        return cls(steps, MAX_CHARS + CHARS_PER_INPUT_CHAR * input_chars, marks, steps)


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar(
    "minigpt_template_budget", default=None
)


@contextlib.contextmanager
def bounded(budget: Budget) -> Iterator[Budget]:
    """Render within `budget` (a template's steps and strings count against it)."""
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def current() -> Budget | None:
    return _BUDGET.get()


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.steps -= 1
        if budget.steps < 0:
            raise Exceeded("steps", budget.limit)


def _chars() -> int:
    budget = _BUDGET.get()
    return budget.chars if budget is not None else 1 << 62


_SIZED = (str, list, tuple)


def _check_length(n: int) -> None:
    """Refuse a length past the bound (never below MAX_CHARS: shorter ones pass without looking it up)."""
    if n > MAX_CHARS and n > _chars():
        raise Exceeded("characters", _chars())


def _sized(value: Any) -> Any:
    """`value`, if it is no string or list longer than the bound."""
    if isinstance(value, _SIZED):
        _check_length(len(value))
    return value


def _check_ints(args: Iterable[Any]) -> None:
    """Refuse a width or count past the bound (`center(10**9)`, `'x'.ljust(10**9)`) before it is used."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool):
            _check_length(abs(a))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operator whose result would pass the bound, before it is computed."""
    if operator == "*":
        seq, n = (left, right) if isinstance(left, _SIZED) else (right, left)
        if isinstance(seq, _SIZED) and isinstance(n, int):
            _check_length(len(seq) * n)
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left) > 1 and right * abs(left).bit_length() > _MAX_POWER_BITS:
            raise Exceeded("characters", _chars())
    elif operator == "%" and isinstance(left, str):
        _check_ints(int(w) for w in re.findall(r"\d{7,}", left))  # '%0999999999d' % 1
        _check_ints(right if isinstance(right, tuple) else (right,))  # '%*d' % (10**9, 1)


def _steps(iterable: Any) -> Iterator[Any]:
    """A loop's items, each a step."""
    for item in iterable:
        _step()
        yield item


def _concat(*parts: Any) -> str:
    """`~`: the parts as one string, refused if it would pass the bound."""
    texts = [str(p) for p in parts]
    _check_length(sum(map(len, texts)))
    return "".join(texts)


def _bounded_filter(f: Callable) -> Callable:
    @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment marks
    def bounded_filter(*args: Any, **kwargs: Any) -> Any:
        _check_ints([*args, *kwargs.values()])
        return _sized(f(*args, **kwargs))

    return bounded_filter


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, every render within the `Budget` in force (see the module's docstring)."""

    # Not "+": it is on most templates' hot path, and what it joins is checked where it is read back (a
    # namespace's attribute, a macro's argument) or written out.
    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.globals.update(minigpt_steps=_steps, minigpt_concat=_concat)

    def bound_filters(self) -> None:
        """Check what every filter is asked to make, and makes; call once the filters are all set."""
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _step()
        for a in (*args, *kwargs.values()):
            _sized(a)
        _check_ints([*args, *kwargs.values()])
        return _sized(super().call(context, obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _sized(super().getattr(obj, attribute))  # a text a `{% set %}` block doubled, read back

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _sized(super().getitem(obj, argument))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right))

    def bounded_template(self, source: str) -> Any:
        """`source` compiled with its loops and `~` counted (see the module's docstring)."""
        tree = self.parse(source)
        for loop in tree.find_all(nodes.For):
            loop.iter = self._global_call("minigpt_steps", [loop.iter], loop.lineno)
        for parent in tree.find_all(nodes.Node):
            for field in parent.fields:
                value = getattr(parent, field)
                if isinstance(value, nodes.Concat):
                    setattr(parent, field, self._joined(value))
                elif isinstance(value, list):
                    setattr(
                        parent, field, [self._joined(v) if isinstance(v, nodes.Concat) else v for v in value]
                    )
        return self.from_string(tree)

    def _joined(self, concat: nodes.Concat) -> nodes.Expr:
        return self._global_call("minigpt_concat", concat.nodes, concat.lineno)

    def _global_call(self, name: str, args: list, lineno: int) -> nodes.Expr:
        call = nodes.Call(nodes.Name(name, "load"), list(args), [], None, None)
        return call.set_lineno(lineno).set_environment(self)
