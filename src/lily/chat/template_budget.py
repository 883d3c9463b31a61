"""Bounds on rendering a chat template: a template that loops or grows without end fails with a
named error instead of holding the engine's worker forever or exhausting memory.

Python cannot interrupt a running jinja render from another thread, so the render checks itself.
The template's syntax tree is instrumented before it is compiled:

- every loop iteration (those a loop's `if` filter skips too) and every macro or call-block
  invocation counts one **step** and checks the **deadline** (jinja has no `while`: a loop
  iterates over something that exists, so it ends, but nested loops can take years);
- every piece of output, inside macros and `{% set %}` blocks too, and every `~` concatenation
  is **sized**.

Every operator, call and filter checks the deadline too. The sandbox's own hooks size the rest:
the `*`, `**`, `+` and `%` operators (checked before they run when their result would be too
large, e.g. `'x' * 10**12`), every method call and filter (whose integer arguments, e.g. a width
for `center` or `ljust`, may not exceed the value bound).
No value may be larger than `max_chars` (characters of a string, items of a list; integers stop
at `MAX_INT_BITS`) and the sizes of all values built add up to at most `max_built_chars`, so a
template cannot keep many large values alive either.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import wraps
from typing import Any

import jinja2.nodes as nodes
from jinja2.runtime import Context, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from lily.errors import ChatTemplateLimitError

MiB = 1 << 20


@dataclass(frozen=True)
class TemplateLimits:
    """How much one render of the chat template may do.

    The defaults are far above what a chat template needs for any conversation that fits a
    context (the Qwen-format template of the tests renders 2001 messages with tool calls in
    12k steps), and low enough that a runaway template fails within seconds and a few hundred MB.
    """

    # Loop iterations plus macro calls.
    max_steps: int = 1_000_000
    # Wall-clock seconds of one render.
    max_seconds: float = 10.0
    # The largest single value (characters of a string, items of a list), which includes the
    # rendered prompt.
    max_chars: int = 16 * MiB
    # The sizes of every value built during the render, added up.
    max_built_chars: int = 256 * MiB

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_seconds", "max_chars", "max_built_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"TemplateLimits.{name} must be a positive number, got {value!r}")


class _Budget:
    """What one render has used so far."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.built = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise ChatTemplateLimitError(
                f"the chat template took more than {self.limits.max_steps} loop steps and macro "
                "calls (it loops without end, or far longer than any chat format needs)",
                limit="max_steps",
            )
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(
                f"rendering the chat template took more than {self.limits.max_seconds:g} s",
                limit="max_seconds",
            )

    def check_size(self, size: int) -> None:
        """Refuse a value of `size` before building it."""
        if size > self.limits.max_chars:
            raise ChatTemplateLimitError(
                f"the chat template built a value of {size} characters, more than its limit "
                f"of {self.limits.max_chars}",
                limit="max_chars",
            )

    def sized(self, value: Any, *, count: bool = True) -> Any:
        """`value`, once its size is within the bounds (and counted as built, if `count`)."""
        size = _size(value)
        self.check_size(size)
        if count:
            self.built += size
            if self.built > self.limits.max_built_chars:
                raise ChatTemplateLimitError(
                    f"the chat template built more than {self.limits.max_built_chars} "
                    "characters in all",
                    limit="max_built_chars",
                )
        return value

    def check_arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Integer arguments are widths, counts and sizes: none may exceed the value bound."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                self.check_size(abs(value))

    def check_format(self, text: str) -> None:
        """A format string's widths and precisions, like any number written in it, may not
        exceed the value bound (`'%99999999999d' % 1` would allocate that much)."""
        for digits in _DIGITS.findall(text):
            if len(digits) > len(str(self.limits.max_chars)) or int(digits) > self.limits.max_chars:
                self.check_size(self.limits.max_chars + 1)


_DIGITS = re.compile(r"\d+")
_active: ContextVar[_Budget | None] = ContextVar("lily_template_budget", default=None)


def _size(value: Any) -> int:
    if isinstance(value, str | list | tuple | dict | set | frozenset | bytes):
        return len(value)
    return 0


# Integers are bounded on their own, and far lower than strings: arithmetic on huge integers is
# slow in a single step (squaring one of 16 MB takes minutes), and Python will not print more
# than 4300 digits anyway. 2^16 bits are about 20,000 digits.
MAX_INT_BITS = 1 << 16


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateLimitError(
            f"the chat template computed an integer of about {bits} bits, more than the "
            f"{MAX_INT_BITS} a chat template can need",
            limit="integer_bits",
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _joined_size(separator: Any, items: Any) -> int:
    """An upper estimate of `separator.join(items)` (the items' text or their size)."""
    if not isinstance(items, list | tuple | dict | set | frozenset | str):
        return 0  # a generator: its items are sized as they are made
    step = len(separator) if isinstance(separator, str) else 0
    return sum(len(i) if isinstance(i, str) else 32 for i in items) + step * len(items)


def _budget() -> _Budget:
    budget = _active.get()
    if budget is None:  # only instrumented templates call the hooks, always inside `limited`
        raise RuntimeError("a budgeted chat template was rendered outside `limited`")
    return budget


@contextmanager
def limited(limits: TemplateLimits) -> Iterator[_Budget]:
    """Renders inside this block are bounded by `limits`."""
    budget = _Budget(limits)
    token = _active.set(budget)
    try:
        yield budget
    finally:
        _active.reset(token)


# The globals the instrumented tree calls. Their names cannot be written by a template author
# by accident, and a request cannot set them (template keywords are checked by name).
_STEP = "__lily_step"
_SIZED = "__lily_sized"


def _step(value: Any = "") -> Any:
    """One step; returns `value` (a loop's filter condition, when it wraps one)."""
    _budget().step()
    return value


def _sized(value: Any) -> Any:
    return _budget().sized(value)


def _call(name: str, argument: nodes.Expr | None = None) -> nodes.Call:
    args = [] if argument is None else [argument]
    return nodes.Call(nodes.Name(name, "load"), args, [], None, None)


class _Instrument(NodeTransformer):
    def _count_steps(self, node: nodes.Node) -> nodes.Node:
        self.generic_visit(node)
        node.body.insert(0, nodes.ExprStmt(_call(_STEP)))
        if isinstance(node, nodes.For) and node.test is not None:
            # `{% for x in xs if test %}`: the iterations the test skips are steps too.
            node.test = _call(_STEP, node.test)
        return node

    visit_For = visit_Macro = visit_CallBlock = _count_steps

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [_call(_SIZED, child) for child in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _call(_SIZED, node)


def instrument(tree: nodes.Template) -> nodes.Template:
    """Adds the step and size checks to a parsed template (in place) and returns it."""
    _Instrument().visit(tree)
    return tree


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(function)  # keeps jinja's pass_context / pass_environment markers
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.check_time()
        # The input is the first argument that is not jinja's context or environment.
        values = [a for a in args if not isinstance(a, Context | ImmutableSandboxedEnvironment)]
        budget.check_arguments(tuple(values[1:]), kwargs)
        if values and name == "join":
            separator = values[1] if len(values) > 1 else kwargs.get("d", "")
            budget.check_size(_joined_size(separator, values[0]))
        elif values and name == "indent" and isinstance(values[0], str):
            width = values[1] if len(values) > 1 else kwargs.get("width", 4)
            if isinstance(width, str):
                budget.check_size(len(values[0]) * (1 + len(width)))
        return budget.sized(function(*args, **kwargs))

    return bounded


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the size checks of the operators, calls and filters; renders
    must run inside `limited` and templates must be compiled from an `instrument`ed tree."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals[_STEP] = _step
        self.globals[_SIZED] = _sized

    def finish_setup(self) -> None:
        """Wraps the filters; call after the last filter has been added."""
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.check_time()
        if operator == "*":
            if _is_int(left) and _is_int(right):
                _check_int_bits(left.bit_length() + right.bit_length())
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, str | list | tuple) and isinstance(count, int):
                    budget.check_size(len(sequence) * count)
        elif operator == "**" and _is_int(left) and _is_int(right):
            if abs(left) > 1 and right > 0:
                _check_int_bits(right * (abs(left).bit_length() - 1))
        elif operator == "%" and isinstance(left, str):
            budget.check_format(left)
        return budget.sized(self.binop_table[operator](left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if __obj is _step or __obj is _sized:
            return __context.call(__obj, *args, **kwargs)
        budget = _budget()
        budget.check_time()
        budget.check_arguments(args, kwargs)
        # The sandbox hands out str.format wrapped; the wrapper keeps the bound method.
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            name = getattr(method, "__name__", "")
            if name in ("format", "format_map"):
                budget.check_format(owner)
            elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
                budget.check_size(len(owner) + (len(owner) + 1) * len(args[1]))
            elif name == "join" and args:
                budget.check_size(_joined_size(owner, args[0]))
        result = super().call(__context, __obj, *args, **kwargs)
        # A macro's output was counted piece by piece as it was written.
        return budget.sized(result, count=not isinstance(__obj, Macro))
