"""Argo's ``{{...}}`` variables and the small expression languages a Workflow uses.

- :func:`substitute` replaces ``{{name}}`` from a flat scope and evaluates expression tags
  ``{{=sprig.sha256sum(inputs.parameters['a'] + '|' + inputs.parameters.b)}}``.
- :func:`eval_depends` evaluates a task's ``depends`` (``a && (b.Succeeded || c.Failed)``).
- :func:`eval_when` evaluates a substituted ``when`` (``'fp32' == 'fp32' && 3 > 2``).
- :func:`eval_retry` evaluates a ``retryStrategy.expression`` over ``lastRetry.*``.

One tokenizer and one recursive-descent parser serve all four, a subset of Argo's ``expr``:
``or := and (('||'|'or') and)*``, ``and := not (('&&'|'and') not)*``,
``not := ('!'|'not') not | cmp``, ``cmp := sum (op sum)?``, ``sum := post ('+' post)*``,
``post := atom ('[' or ']' | '(' args ')')*``, ``atom := '(' or ')' | 'text' | number | name``.
Names are dotted (``inputs.parameters.x``, ``task.Succeeded``); the functions are the two
the pipeline's YAML calls (``sprig.sha256sum``, ``asInt``). Anything else is refused with the
field. (``simpleeval`` was considered: it parses Python, so Argo's ``&&``, ``!`` and dashed
names would need a translation layer, and the result would be neither smaller nor stricter.)
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, Mapping

from emulator.errors import LocalRunError

_VAR = re.compile(r"\{\{(.*?)\}\}")
_TOKEN = re.compile(r"""\s*(?:(\|\||&&|==|!=|<=|>=|[()\[\],!<>+])|'([^']*)'|"([^"]*)"|"""
                    r"""(\d+\.\d+|\d+(?![\w\-]))|([A-Za-z_][\w.\-]*))""")

# What a bare `task` means in `depends`, and which `task.Result` names Argo defines.
_DEFAULT_OK = ("Succeeded", "Skipped", "Daemoned")
_RESULTS = ("Succeeded", "Failed", "Errored", "Skipped", "Omitted", "Daemoned")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _int(value: Any) -> int:
    return int(float(value)) if not isinstance(value, bool) else int(value)


# Only the functions the pipeline's YAML calls: a memo key's hash and the retry expression's
# exit-code conversion. Any other function is refused by name, as an unsupported field is.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sprig.sha256sum": lambda s: hashlib.sha256(_text(s).encode()).hexdigest(),
    "asInt": _int,
}


class _Name(str):
    """A dotted name not yet looked up (``inputs.parameters.x``)."""


def _tokenize(text: str, where: str) -> list[tuple[str, Any]]:
    tokens, pos, text = [], 0, text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise LocalRunError(f"{where}: cannot parse {text!r} at {text[pos:]!r}")
        op, single, double, number, word = match.groups()
        if op:
            tokens.append(("op", op))
        elif number is not None:
            tokens.append(("num", float(number) if "." in number else int(number)))
        elif word is not None:
            tokens.append(("op", word) if word in ("and", "or", "not") else ("name", word))
        else:
            tokens.append(("str", single if single is not None else double))
        pos = match.end()
    return tokens


class _Parser:
    """Evaluates while it parses; ``resolve(name)`` gives a dotted name's value."""

    def __init__(self, text: str, where: str, resolve: Callable[[str], Any]):
        self.tokens = _tokenize(text, where)
        self.where, self.text, self.resolve = where, text, resolve
        self.pos = 0

    def fail(self, why: str) -> LocalRunError:
        return LocalRunError(f"{self.where}: {why} in {self.text!r}")

    def peek(self) -> tuple[str, Any] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, *ops: str) -> str | None:
        token = self.peek()
        if token and token[0] == "op" and token[1] in ops:
            self.pos += 1
            return token[1]
        return None

    def expect(self, op: str) -> None:
        if not self.take(op):
            raise self.fail(f"missing {op!r}")

    def run(self) -> Any:
        if not self.tokens:
            raise self.fail("empty expression")
        value = self.value(self.or_())
        if self.peek() is not None:
            raise self.fail(f"unexpected {self.peek()[1]!r}")
        return value

    def value(self, item: Any) -> Any:
        return self.resolve(str(item)) if isinstance(item, _Name) else item

    def boolean(self, item: Any) -> bool:
        value = self.value(item)
        if not isinstance(value, bool):
            raise self.fail(f"{value!r} is not true or false")
        return value

    def or_(self) -> Any:
        value = self.and_()
        while self.take("||", "or"):
            right = self.and_()
            value = self.boolean(value) | self.boolean(right)
        return value

    def and_(self) -> Any:
        value = self.not_()
        while self.take("&&", "and"):
            right = self.not_()
            value = self.boolean(value) & self.boolean(right)
        return value

    def not_(self) -> Any:
        if self.take("!", "not"):
            return not self.boolean(self.not_())
        return self.cmp()

    def cmp(self) -> Any:
        left = self.sum()
        op = self.take("==", "!=", "<", ">", "<=", ">=")
        if op is None:
            return left
        return _compare(self.value(left), op, self.value(self.sum()))

    def sum(self) -> Any:
        value = self.post()
        while self.take("+"):
            left, right = self.value(value), self.value(self.post())
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool)
                          for v in (left, right))
            value = left + right if numbers else _text(left) + _text(right)
        return value

    def post(self) -> Any:
        item = self.atom()
        while True:
            if self.take("["):
                index = self.value(self.or_())
                self.expect("]")
                if not isinstance(item, _Name):
                    raise self.fail("indexing is only supported on names")
                item = _Name(f"{item}.{index}")
            elif self.take("("):
                item = self.call(item)
            else:
                return item

    def call(self, item: Any) -> Any:
        if not isinstance(item, _Name) or str(item) not in FUNCTIONS:
            raise self.fail(f"function {item!r} is not supported by the local runner "
                            f"(known: {', '.join(sorted(FUNCTIONS))})")
        args = []
        if not self.take(")"):
            args.append(self.value(self.or_()))
            while self.take(","):
                args.append(self.value(self.or_()))
            self.expect(")")
        try:
            return FUNCTIONS[item](*args)
        except (TypeError, ValueError) as exc:
            raise self.fail(f"{item}(): {exc}") from None

    def atom(self) -> Any:
        if self.take("("):
            value = self.or_()
            self.expect(")")
            return value
        token = self.peek()
        if token is None or token[0] == "op":
            raise self.fail("expected a name or a value")
        self.pos += 1
        kind, value = token
        return _Name(value) if kind == "name" else value


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _compare(left: Any, op: str, right: Any) -> bool:
    """Numbers compare as numbers (``2 < 10``), anything else as text."""
    a, b = _number(left), _number(right)
    if a is None or b is None:
        a, b = _text(left), _text(right)
    return {"==": a == b, "!=": a != b, "<": a < b, ">": a > b,
            "<=": a <= b, ">=": a >= b}[op]


def evaluate(text: str, resolve: Callable[[str], Any], where: str) -> Any:
    return _Parser(text, where, resolve).run()


def scope_resolver(scope: Mapping[str, Any], where: str) -> Callable[[str], Any]:
    def resolve(name: str) -> Any:
        if name not in scope:
            raise LocalRunError(f"{where}: unknown variable {name!r} in an expression")
        return scope[name]
    return resolve


def variables(text: str) -> list[str]:
    """The names inside ``{{...}}`` in ``text``, stripped."""
    return [m.group(1).strip() for m in _VAR.finditer(text)]


def substitute(value: Any, scope: Mapping[str, Any], where: str) -> Any:
    """Replace every ``{{name}}`` and ``{{=expr}}`` in ``value`` (strings, lists, dicts)."""
    if isinstance(value, list):
        return [substitute(v, scope, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: substitute(v, scope, f"{where}.{k}") for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        name = match.group(1).strip()
        if name.startswith("="):
            return _text(evaluate(name[1:], scope_resolver(scope, where), where))
        if name not in scope:
            raise LocalRunError(f"{where}: unknown variable {{{{{name}}}}}")
        return _text(scope[name])

    return _VAR.sub(one, value)


def eval_depends(text: str, phases: Mapping[str, str], where: str) -> bool:
    """Evaluate Argo's ``depends`` against finished tasks' phases (Argo's NodePhase names).

    ``task`` alone means ``task.Succeeded || task.Skipped || task.Daemoned``; a task name
    that is not in ``phases`` or a result Argo does not define is refused.
    """
    def resolve(text: str) -> bool:
        name, _, result = text.partition(".")
        if name not in phases:
            raise LocalRunError(f"{where}: depends names unknown task {name!r}")
        if not result:
            return phases[name] in _DEFAULT_OK
        if result in ("AnySucceeded", "AllFailed"):
            raise LocalRunError(f"{where}: {text} only applies to expanded tasks "
                                "(withItems/withParam), which the local runner does not run")
        if result not in _RESULTS:
            raise LocalRunError(f"{where}: unknown task result {text!r} in depends")
        return phases[name] == ("Error" if result == "Errored" else result)

    parser = _Parser(text, where, resolve)
    return parser.boolean(parser.run())


def depends_names(text: str, where: str) -> list[str]:
    """Task names referenced by a ``depends`` expression, in order of appearance."""
    names: list[str] = []
    for kind, value in _tokenize(text, where):
        if kind == "name" and value.partition(".")[0] not in names:
            names.append(value.partition(".")[0])
    return names


def eval_when(text: str, where: str) -> bool:
    """Evaluate a ``when`` whose variables are substituted; bare words are text."""
    def resolve(name: str) -> Any:
        return name == "true" if name in ("true", "false") else name

    parser = _Parser(text, where, resolve)
    return parser.boolean(parser.run())


def eval_retry(text: str, last: Mapping[str, Any], where: str) -> bool:
    """Evaluate ``retryStrategy.expression`` over ``lastRetry.exitCode``, ``.status``,
    ``.duration`` and ``.message``."""
    scope = {f"lastRetry.{k}": v for k, v in last.items()}
    parser = _Parser(text, where, scope_resolver(scope, where))
    return parser.boolean(parser.run())
