"""Verifiable rewards: `fn(prompt: str, response: str, answer: str) -> float`.

Built in:
- `math`: the last `\\boxed{...}` / `\\fbox{...}` of the response against the answer (itself unboxed if
  boxed), equal after normalization, numerically (ints, decimals, fractions, percentages, scientific
  notation, with a relative tolerance) or symbolically (sympy). 1.0 or 0.0.
- `exact_match`: stripped strings equal. 1.0 or 0.0.
- `positional_match`: share of answer characters reproduced at the same position (dense partial credit for
  the built-in synthetic tasks).
- any user function by import path `"package.module:function"`.

Symbolic parsing never calls `eval` (sympy's `parse_expr` does): a small recursive-descent parser for the
LaTeX-ish answer language builds sympy objects directly, with limits on input length, literal size,
exponents and factorials, so that an adversarial response cannot hang the reward worker.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

RewardFn = Callable[[str, str, str], float]

__all__ = [
    "RewardFn",
    "extract_boxed",
    "normalize_answer",
    "parse_math",
    "answers_match",
    "math_reward",
    "exact_match_reward",
    "positional_match_reward",
    "load_reward_fn",
    "get_reward_fn",
    "compute_rewards",
    "BUILTIN_REWARDS",
]

# ---------------------------------------------------------------------------------------------------------
# \boxed{} extraction

_BOX_RE = re.compile(r"\\(boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the `{...}` group opening at `text[start]`, honouring nesting and `\\{`; with the end."""
    if start >= len(text) or text[start] != "{":
        return None
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last well-formed `\\boxed{...}` or `\\fbox{...}` (also `\\boxed 5`), else None."""
    for m in reversed(list(_BOX_RE.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            got = _braced(text, i)
            if got is not None:
                return got[0].strip()
            continue
        if i > m.end():  # `\boxed 5`: one whitespace-delimited token
            token = re.match(r"[^\s$]+", text[i:])
            if token:
                return token.group(0).rstrip(".")
    return None


# ---------------------------------------------------------------------------------------------------------
# normalization

_UNIT_WORDS = (
    "degrees?", "radians?", "cm", "mm", "km", "m", "meters?", "centimeters?", "kilometers?", "inch(?:es)?",
    "in", "feet", "foot", "ft", "yards?", "miles?", "mph", "kg", "g", "grams?", "kilograms?", "pounds?",
    "lbs?", "ounces?", "oz", "seconds?", "sec", "s", "minutes?", "min", "hours?", "hrs?", "days?", "weeks?",
    "months?", "years?", "dollars?", "cents?", "units?", "square", "sq", "cubic", "liters?", "ml", "L",
    "percent", "people", "students", "points?", "times", "ways", "and",
)
_UNIT_TAIL_RE = re.compile(r"(?:\s*(?:" + "|".join(_UNIT_WORDS) + r")(?:\^\{?[23]\}?)?)+\s*$")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ASSIGN_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?!=)")


def _fix_shorthand_groups(s: str) -> str:
    """`\\frac12` → `\\frac{1}{2}`, `\\frac1b` → `\\frac{1}{b}`, `\\sqrt2` → `\\sqrt{2}`."""
    s = re.sub(r"\\frac\s*(\w)\s*(\w)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\w)", r"\\frac\1{\2}", s)
    s = re.sub(r"\\frac\s*(\w)\s*(\{)", r"\\frac{\1}\2", s)
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)
    return s


def normalize_answer(text: str) -> str:
    """Canonical string form of an answer: formatting, units and wrappers removed, spaces dropped.

    Removes `\\boxed`, `$`, `\\left`/`\\right`, LaTeX spacing, `^\\circ`/degree signs, `\\text{}` wrappers,
    trailing unit words and a trailing period, `x =` prefixes and thousands separators; maps
    `\\dfrac`/`\\tfrac` to `\\frac` and `\\%` to `%`.
    """
    s = text.strip()
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.replace("\n", " ").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[!,;: ]", "", s).replace("~", " ")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "").replace("\\degree", "")
    s = s.replace("\\%", "%").replace("\\displaystyle", "")
    for _ in range(3):  # nested \text{\textbf{..}}
        s = _TEXT_CMD_RE.sub(r"\1", s)
    s = s.strip()
    s = _ASSIGN_RE.sub("", s) if s.count("=") == 1 else s
    s = s.strip().rstrip(".").strip()
    stripped = _UNIT_TAIL_RE.sub("", s)
    if stripped and re.search(r"[\d}]$", stripped.strip()):
        s = stripped
    s = _fix_shorthand_groups(s)
    # Drop spaces, except the one ending a command before a letter (`\sin x` must not become `\sinx`).
    s = re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])", "\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ").rstrip(".")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)  # .5 → 0.5
    return s


# ---------------------------------------------------------------------------------------------------------
# a safe parser for LaTeX-ish math → sympy


class MathParseError(ValueError):
    """The string is not in the supported answer language (or exceeds a safety limit)."""


MAX_INPUT_CHARS = 256
MAX_LITERAL_DIGITS = 64
MAX_ABS_EXPONENT = 512
MAX_SYMBOLIC_EXPONENT = 64
MAX_FACTORIAL = 100

_TOKEN_RE = re.compile(
    r"\s*(?:"
    r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<cmd>\\[A-Za-z]+)"
    r"|(?P<name>[A-Za-z])"
    r"|(?P<op>\*\*|[-+*/^(){}\[\]!%,|])"
    r")"
)
_FUNCTIONS = ("sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "arcsin", "arccos", "arctan")
_PLAIN_FUNCTIONS = re.compile(r"(?<![\\A-Za-z])(" + "|".join(sorted(_FUNCTIONS, key=len, reverse=True)) + r"|sqrt|pi)(?![A-Za-z])")


def _tokenize(s: str) -> list[tuple[str, str]]:
    s = _PLAIN_FUNCTIONS.sub(r"\\\1", s)  # plain `sqrt`, `sin`, `pi` → commands
    tokens, pos = [], 0
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if m is None or m.end() == pos:
            if s[pos:].strip() == "":
                break
            raise MathParseError(f"unexpected character {s[pos]!r} at {pos} in {s!r}")
        kind = m.lastgroup
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        import sympy

        self.sp = sympy
        self.tokens = tokens
        self.i = 0

    # token helpers
    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise MathParseError("unexpected end of expression")
        self.i += 1
        return tok

    def expect(self, value: str) -> None:
        tok = self.take()
        if tok[1] != value:
            raise MathParseError(f"expected {value!r}, got {tok[1]!r}")

    def at(self, *values: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[1] in values

    # grammar
    def parse(self):
        value = self.expr()
        if self.peek() is not None:
            raise MathParseError(f"trailing input at token {self.peek()[1]!r}")
        return value

    def expr(self):
        value = self.term()
        while self.at("+", "-", "\\pm"):
            op = self.take()[1]
            if op == "\\pm":
                raise MathParseError("\\pm is not a single value")
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def _starts_atom(self) -> bool:
        tok = self.peek()
        if tok is None:
            return False
        kind, value = tok
        if kind in ("num", "name"):
            return True
        if kind == "cmd":
            return value not in ("\\cdot", "\\times", "\\div", "\\pm")
        return value in ("(", "{", "[", "|")

    def term(self):
        value = self.unary()
        while True:
            if self.at("*", "\\cdot", "\\times"):
                self.take()
                value = value * self.unary()
            elif self.at("/", "\\div"):
                self.take()
                rhs = self.unary()
                if rhs == 0:
                    raise MathParseError("division by zero")
                value = value / rhs
            elif self._starts_atom():
                value = value * self.power()  # implicit multiplication: 2x, 2\pi, 3(x+1)
            else:
                return value

    def unary(self):
        if self.at("-"):
            self.take()
            return -self.unary()
        if self.at("+"):
            self.take()
            return self.unary()
        return self.power()

    def power(self):
        base = self.postfix()
        if self.at("^", "**"):
            self.take()
            exponent = self.unary()
            return self._pow(base, exponent)
        return base

    def _pow(self, base, exponent):
        """`base ** exponent`, refusing powers whose exact value or expansion would be huge to compute."""
        if exponent.is_number:
            limit = MAX_SYMBOLIC_EXPONENT if base.free_symbols else MAX_ABS_EXPONENT
            if not exponent.is_real or abs(float(exponent)) > limit:
                raise MathParseError(f"exponent {exponent} outside the safety limit ±{limit}")
            if base.is_number and base.is_real and base != 0:
                digits = abs(float(exponent)) * abs(math.log10(abs(float(base))))
                if digits > 4 * MAX_ABS_EXPONENT:
                    raise MathParseError(f"power with about {digits:.0f} digits is too large")
        return self.sp.Pow(base, exponent)

    def postfix(self):
        value = self.atom()
        while self.at("!", "%"):
            op = self.take()[1]
            if op == "%":
                value = value / 100
            else:
                if not (value.is_Integer and 0 <= value <= MAX_FACTORIAL):
                    raise MathParseError(f"factorial only of integers in [0, {MAX_FACTORIAL}]")
                value = self.sp.factorial(value)
        return value

    def group(self):
        """`{expr}` or a single token (for `\\frac12` style)."""
        if self.at("{"):
            self.take()
            value = self.expr()
            self.expect("}")
            return value
        kind, value = self.take()
        if kind == "num":
            if len(value) > 1 and value.isdigit():  # TeX takes one digit: \frac123 = \frac{1}{2}3
                self.tokens.insert(self.i, ("num", value[1:]))
                value = value[0]
            return self._number(value)
        if kind == "name":
            return self.sp.Symbol(value)
        raise MathParseError(f"expected a group, got {value!r}")

    def _number(self, text: str):
        digits = len(re.sub(r"[^0-9]", "", text.split("e")[0].split("E")[0]))
        if digits > MAX_LITERAL_DIGITS:
            raise MathParseError(f"numeric literal longer than {MAX_LITERAL_DIGITS} digits")
        mantissa, _, exp = text.lower().partition("e")
        if exp and abs(int(exp)) > MAX_ABS_EXPONENT:
            raise MathParseError("scientific exponent too large")
        value = self.sp.Rational(Fraction(mantissa)) if mantissa not in ("", ".") else None
        if value is None:
            raise MathParseError(f"bad number {text!r}")
        if exp:
            value = value * self.sp.Integer(10) ** int(exp)
        return value

    def atom(self):
        sp = self.sp
        kind, value = self.take()
        if kind == "num":
            return self._number(value)
        if kind == "name":
            return sp.Symbol(value)
        if value in ("(", "{", "["):
            close = {"(": ")", "{": "}", "[": "]"}[value]
            inner = self.expr()
            self.expect(close)
            return inner
        if value == "|":
            inner = self.expr()
            self.expect("|")
            return sp.Abs(inner)
        if kind == "cmd":
            name = value[1:]
            if name == "frac":
                num = self.group()
                den = self.group()
                if den == 0:
                    raise MathParseError("division by zero")
                return num / den
            if name == "sqrt":
                if self.at("["):
                    self.take()
                    index = self.expr()
                    self.expect("]")
                    return self._pow(self.group(), 1 / index)
                return sp.sqrt(self.group())
            if name == "pi":
                return sp.pi
            if name == "infty":
                return sp.oo
            if name in _FUNCTIONS:
                fn = {"ln": sp.log, "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan}.get(
                    name, getattr(sp, name, None))
                return fn(self.power())
            if name in ("alpha", "beta", "gamma", "theta", "lambda", "mu", "sigma", "phi", "omega"):
                return sp.Symbol(name)
        raise MathParseError(f"unsupported token {value!r}")


def parse_math(text: str):
    """Parse a normalized answer into a sympy expression without `eval`; raises MathParseError."""
    if len(text) > MAX_INPUT_CHARS:
        raise MathParseError(f"answer longer than {MAX_INPUT_CHARS} characters")
    tokens = _tokenize(text)
    if not tokens:
        raise MathParseError("empty expression")
    return _Parser(tokens).parse()


# ---------------------------------------------------------------------------------------------------------
# equality


@dataclasses.dataclass(frozen=True)
class MatchConfig:
    rel_tol: float = 1e-6
    abs_tol: float = 1e-9


_PROBE_POINTS = (0.5731, 1.3179, -0.7713, 2.2417)


def _numbers_close(a, b, cfg: MatchConfig) -> bool:
    if a.is_Rational and b.is_Rational:
        if a == b:
            return True
    try:
        fa, fb = complex(a.evalf(30)), complex(b.evalf(30))
    except (TypeError, ValueError):
        return False
    if not (np.isfinite(fa) and np.isfinite(fb)):
        return a == b
    return abs(fa - fb) <= max(cfg.abs_tol, cfg.rel_tol * max(abs(fa), abs(fb)))


_MAX_EXPAND_POWER = 8


def _cheap_to_expand(expr) -> bool:
    """`expand((x+y+z)^512)` has ~10^5 terms: only expand small powers of symbolic bases (else probe)."""
    import sympy as sp

    for node in expr.atoms(sp.Pow):
        base, exponent = node.as_base_exp()
        if base.free_symbols and (not exponent.is_number or abs(float(exponent)) > _MAX_EXPAND_POWER):
            return False
    return True


def _expressions_equal(a, b, cfg: MatchConfig) -> bool:
    import sympy as sp

    if a.is_number and b.is_number:
        return _numbers_close(a, b, cfg)
    if a.free_symbols != b.free_symbols:
        return False
    if _cheap_to_expand(a) and _cheap_to_expand(b):
        try:
            if sp.expand(a - b) == 0:
                return True
        except Exception:  # sympy can raise many things on odd input; then fall through to probing
            pass
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    good = 0
    for k, _ in enumerate(_PROBE_POINTS):
        subs = {s: _PROBE_POINTS[(k + j) % len(_PROBE_POINTS)] for j, s in enumerate(symbols)}
        try:
            va, vb = complex(a.evalf(30, subs=subs)), complex(b.evalf(30, subs=subs))
        except (TypeError, ValueError):
            continue
        if not (np.isfinite(va) and np.isfinite(vb)):
            continue
        if abs(va - vb) > max(cfg.abs_tol, cfg.rel_tol * max(abs(va), abs(vb))):
            return False
        good += 1
    return good >= 2


def _split_top_level(s: str) -> tuple[str, list[str], str]:
    """`(a,b]` → (`(`, [a, b], `]`); no top-level comma → ("", [s], "")."""
    open_, close = "", ""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner_depth, balanced = 0, True
        for k, c in enumerate(s[1:-1]):
            inner_depth += c in "([{"
            inner_depth -= c in ")]}"
            if inner_depth < 0:
                balanced = False
                break
        if balanced and inner_depth == 0:
            open_, close, s = s[0], s[-1], s[1:-1]
    parts, depth, cur = [], 0, ""
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    parts.append(cur)
    if len(parts) == 1:
        return "", [(open_ + s + close) if open_ else s], ""
    return open_, parts, close


def _scalar_match(pred: str, gold: str, cfg: MatchConfig) -> bool:
    if pred == gold:
        return True
    try:
        a, b = parse_math(pred), parse_math(gold)
    except (MathParseError, ZeroDivisionError, ValueError, TypeError, OverflowError, RecursionError):
        return False
    if _expressions_equal(a, b, cfg):
        return True
    # A percentage on one side only: "50%" also matches "50" (and 0.5 by the parse above).
    if ("%" in pred) != ("%" in gold):
        try:
            a2, b2 = parse_math(pred.replace("%", "")), parse_math(gold.replace("%", ""))
        except (MathParseError, ZeroDivisionError, ValueError, TypeError, OverflowError, RecursionError):
            return False
        return _expressions_equal(a2, b2, cfg)
    return False


def answers_match(pred: str, gold: str, config: MatchConfig = MatchConfig()) -> bool:
    """True when two answers are equal after normalization, numerically or symbolically.

    Comma-separated answers (tuples, intervals, lists) match element-wise in order, with the same brackets.
    """
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    po, pp, pc = _split_top_level(p)
    go, gp, gc = _split_top_level(g)
    if len(pp) > 1 or len(gp) > 1:
        return (po, pc) == (go, gc) and len(pp) == len(gp) and all(
            _scalar_match(x, y, config) for x, y in zip(pp, gp))
    return _scalar_match(p, g, config)


# ---------------------------------------------------------------------------------------------------------
# reward functions


def math_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's last `\\boxed{}` equals the answer (see `answers_match`), else 0.0."""
    del prompt
    pred = extract_boxed(response)
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, answer) else 0.0


def exact_match_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the stripped response equals the stripped answer."""
    del prompt
    return 1.0 if response.strip() == answer.strip() else 0.0


def positional_match_reward(prompt: str, response: str, answer: str) -> float:
    """Share of the answer's characters the response reproduces at the same position, in [0, 1].

    Characters past `len(answer)` are ignored; a shorter response scores only what it has. This gives the
    dense reward that lets a randomly initialized policy learn the built-in tasks by RL.
    """
    del prompt
    if not answer:
        raise ValueError("positional_match_reward needs a non-empty answer")
    hits = sum(1 for a, r in zip(answer, response) if a == r)
    return hits / len(answer)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "positional_match": positional_match_reward,
}


def load_reward_fn(spec: str) -> RewardFn:
    """Import a user reward `"package.module:function"` and check it takes `(prompt, response, answer)`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward function {spec!r}: {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable (got {type(fn).__name__})")
    try:
        inspect.signature(fn).bind("prompt", "response", "answer")
    except TypeError as e:
        raise ValueError(
            f"reward function {spec!r} must accept (prompt: str, response: str, answer: str): {e}"
        ) from e
    except ValueError:
        pass  # builtins without a signature: trust and let the call fail loudly
    return fn


def get_reward_fn(spec: str) -> RewardFn:
    """A built-in reward by name (see `BUILTIN_REWARDS`) or a user one by `"module:function"`."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" in spec:
        return load_reward_fn(spec)
    raise ValueError(f"unknown reward {spec!r}: use one of {sorted(BUILTIN_REWARDS)} or 'package.module:function'")


def compute_rewards(
    fn: RewardFn, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]
) -> np.ndarray:
    """Rewards `[N]` float32 for a batch; a non-numeric or non-finite reward is an error naming the sample."""
    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(
            f"prompts ({len(prompts)}), responses ({len(responses)}) and answers ({len(answers)}) differ in length"
        )
    out = np.empty(len(responses), np.float32)
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers)):
        value = fn(p, r, a)
        if isinstance(value, (bool, np.bool_)):
            value = float(value)
        if not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(float(value)):
            name = getattr(fn, "__qualname__", repr(fn))
            raise ValueError(f"reward function {name} returned {value!r} for sample {i}: need a finite float")
        out[i] = float(value)
    return out
