"""Math answer checking (extraction, normalization, numeric and symbolic equality), exact match, positional
credit, user reward loading and the batch helper."""

import time

import numpy as np
import pytest

from jaxrl_fp8.rl.rewards import (
    MathParseError,
    answers_match,
    compute_rewards,
    exact_match_reward,
    extract_boxed,
    get_reward_fn,
    load_reward_fn,
    math_reward,
    normalize_answer,
    parse_math,
    positional_match_reward,
)


# helpers that the loader tests import by path ---------------------------------------------------------------
def good_reward(prompt, response, answer):
    return float(response == answer)


def two_arg_reward(prompt, response):
    return 0.0


NOT_CALLABLE = 3


@pytest.mark.parametrize("text, expected", [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("nested \\boxed{\\frac{a^{2}}{\\sqrt{b}}} ok", "\\frac{a^{2}}{\\sqrt{b}}"),
    ("first \\boxed{3} then \\boxed{4}", "4"),
    ("\\fbox{7}", "7"),
    ("\\boxed 5.", "5"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{1} and a broken \\boxed{2", "1"),  # the last *well-formed* box
    ("no box at all 5", None),
    ("\\boxeddog{3}", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("raw, expected", [
    ("$\\dfrac{3}{4}$", "\\frac{3}{4}"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("\\$12.50", "12.50"),
    ("5 \\text{ cm}", "5"),
    ("12 \\text{dollars}", "12"),
    ("x = 5", "5"),
    ("1,000,000", "1000000"),
    ("7.", "7"),
    ("\\frac12", "\\frac{1}{2}"),
    ("\\sqrt2", "\\sqrt{2}"),
    (".5", "0.5"),
    ("10\\%", "10%"),
    ("\\boxed{\\tfrac{1}{3}}", "\\frac{1}{3}"),
    ("\\text{(A)}", "(A)"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize("pred, gold, equal", [
    ("\\frac{1}{2}", "0.5", True),
    ("0.50", "1/2", True),
    ("1.5e3", "1500", True),
    ("1.5\\times 10^{3}", "1500", True),
    ("3 \\cdot 10^{-2}", "0.03", True),
    ("50\\%", "0.5", True),
    ("50\\%", "50", True),
    ("0.333", "\\frac{1}{3}", False),  # tolerance is relative 1e-6, not "close enough"
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("2x + 1", "1 + 2x", True),
    ("2x", "2y", False),
    ("\\sin x", "\\sin(x)", True),  # the space ends the command: not `\\sinx`
    ("\\pi r^2", "r^{2}\\pi", True),
    ("\\sqrt{x^2}", "x", False),  # it is |x|
    ("(x+y)^{3}", "x^3+3x^2y+3xy^2+y^3", True),
    ("\\sqrt[3]{27}", "3", True),
    ("-3", "3", False),
    ("(1,2)", "(1, 2)", True),
    ("(1,2]", "(1,2)", False),
    ("(2,1)", "(1,2)", False),
    ("10", "10.0001", False),
    ("10", "10.000000001", True),  # within rel_tol 1e-6
    ("\\infty", "\\infty", True),
    ("5!", "120", True),
    ("A", "A", True),
    ("", "0", False),
])
def test_answers_match(pred, gold, equal):
    assert answers_match(pred, gold) is equal


def test_math_reward_end_to_end():
    assert math_reward("q", "so \\boxed{\\dfrac{1}{2}}", "0.5") == 1.0
    assert math_reward("q", "so \\boxed{\\dfrac{1}{2}}", "\\boxed{\\frac12}") == 1.0
    assert math_reward("q", "the answer is 0.5", "0.5") == 0.0  # no box, no credit
    assert math_reward("q", "\\boxed{3}", "4") == 0.0


@pytest.mark.parametrize("text", ["2^{10000000}", "9^{9^{9}}", "1000!", "1" * 200, "10^{-100000}",
                                  "(x+y+z)^{512}"])
def test_adversarial_answers_fail_fast(text):
    start = time.perf_counter()
    with pytest.raises(MathParseError):
        parse_math(normalize_answer(text))
    assert math_reward("", f"\\boxed{{{text}}}", "1") == 0.0
    assert time.perf_counter() - start < 2.0


def test_parser_never_evaluates_code():
    for text in ["__import__('os')", "().__class__", "lambda: 1", "x.y"]:
        with pytest.raises(MathParseError):
            parse_math(text)


def test_exact_and_positional():
    assert exact_match_reward("", "  abc \n", "abc") == 1.0
    assert exact_match_reward("", "abd", "abc") == 0.0
    assert positional_match_reward("", "123", "123") == 1.0
    assert positional_match_reward("", "193", "123") == pytest.approx(2 / 3)
    assert positional_match_reward("", "1", "123") == pytest.approx(1 / 3)
    assert positional_match_reward("", "12345", "123") == 1.0  # characters past the answer are ignored
    assert positional_match_reward("", "", "12") == 0.0


def test_load_reward_fn_by_path_and_errors():
    fn = load_reward_fn("tests.rl.test_rewards:good_reward")
    assert fn("p", "a", "a") == 1.0
    assert get_reward_fn("math") is math_reward
    with pytest.raises(ValueError, match="must look like"):
        load_reward_fn("tests.rl.test_rewards.good_reward")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz.mod'"):
        load_reward_fn("no_such_pkg_xyz.mod:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_reward_fn("tests.rl.test_rewards:missing")
    with pytest.raises(ValueError, match="not callable"):
        load_reward_fn("tests.rl.test_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"must accept \(prompt"):
        load_reward_fn("tests.rl.test_rewards:two_arg_reward")
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward_fn("nope")


def test_compute_rewards_batch_and_errors():
    out = compute_rewards(positional_match_reward, ["", ""], ["12", "10"], ["12", "12"])
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [1.0, 0.5])
    with pytest.raises(ValueError, match="differ in length"):
        compute_rewards(positional_match_reward, [""], ["1", "2"], ["1", "2"])
    with pytest.raises(ValueError, match="sample 1"):
        compute_rewards(lambda p, r, a: float("nan") if r == "b" else 1.0, ["", ""], ["a", "b"], ["", ""])
    with pytest.raises(ValueError, match="sample 0"):
        compute_rewards(lambda p, r, a: "1.0", [""], ["a"], [""])
    np.testing.assert_array_equal(compute_rewards(lambda p, r, a: r == a, ["", ""], ["a", "b"], ["a", "a"]), [1, 0])
