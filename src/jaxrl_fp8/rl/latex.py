"""Reading LaTeX answers: the last `\\boxed{...}`, a canonical string form, and a safe parse to sympy.

`parse_math` never calls `eval` (sympy's `parse_expr` does): a small recursive-descent parser for the LaTeX-ish
answer language (numbers incl. scientific, `+ - * / ^`, `\\cdot \\times \\div`, implicit products, `\\frac`,
`\\sqrt`, `|x|`, `!`, `%`, the common functions and Greek letters) builds sympy objects directly, with limits
on input length, literal size, exponents and factorials, so that an adversarial response cannot hang the
reward worker. sympy is imported on the first parse only.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = ["MathParseError", "extract_boxed", "normalize_answer", "parse_math"]

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
