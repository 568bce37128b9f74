"""Verifiable rewards: `fn(prompt: str, response: str, answer: str) -> float`.

Built in:
- `math`: the last `\\boxed{...}` / `\\fbox{...}` of the response against the answer (itself unboxed if
  boxed), equal after normalization, numerically (ints, decimals, fractions, percentages, scientific
  notation, with a relative tolerance) or symbolically (sympy). 1.0 or 0.0.
- `exact_match`: stripped strings equal. 1.0 or 0.0.
- `positional_match`: share of answer characters reproduced at the same position (dense partial credit for
  the built-in synthetic tasks).
- any user function by import path `"package.module:function"`.

Answers are read by `rl.latex` (extraction, normalization, and a parser to sympy that never calls `eval`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_fp8.rl.latex import MathParseError, extract_boxed, normalize_answer, parse_math

RewardFn = Callable[[str, str, str], float]

__all__ = [
    "RewardFn",
    "MathParseError",
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
