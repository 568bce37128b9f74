"""Built-in synthetic tasks: examples, deterministic disjoint splits, and the random-policy reward formula."""

import pytest

from jaxrl_fp8.data.builtin_tokenizer import builtin_tokenizer
from jaxrl_fp8.data.synthetic import (
    TASK_NAMES,
    SyntheticTask,
    make_task,
    random_policy_expected_reward,
    random_policy_reward_mc,
    synthetic_splits,
)
from jaxrl_fp8.rl.rewards import get_reward_fn


def test_examples():
    assert make_task("copy").example(7) == ("07=", "07")
    assert make_task("reverse").example(123) == ("123<", "321")
    assert make_task("add").example(37) == ("3+7=", "10")
    assert make_task("add", 2).example(1234) == ("12+34=", "046")
    assert SyntheticTask("copy", 3).space_size == 1000 and make_task("add").space_size == 100


@pytest.mark.parametrize("name", TASK_NAMES)
def test_every_prompt_tokenizes_to_the_fixed_length_and_answers_score_max(name):
    task, tok = make_task(name), builtin_tokenizer()
    reward = get_reward_fn(task.reward)
    for i in range(0, task.space_size, max(1, task.space_size // 50)):
        prompt, answer = task.example(i)
        assert len(tok.encode(prompt)) == len(prompt) == task.prompt_length
        assert len(answer) == task.answer_length
        assert tok.decode(tok.encode(answer)) == answer
        assert reward(prompt, answer, answer) == task.max_reward


def test_splits_are_disjoint_deterministic_and_cover():
    task = make_task("reverse")
    train, evals = synthetic_splits(task, seed=11)
    assert len(train) == 900 and len(evals) == 100
    assert not {r.uid for r in train} & {r.uid for r in evals}
    assert {r.uid for r in train} | {r.uid for r in evals} == set(range(1000))
    again = synthetic_splits(task, seed=11)
    assert [r.uid for r in again[0]] == [r.uid for r in train]
    other = synthetic_splits(task, seed=12)
    assert [r.uid for r in other[0]] != [r.uid for r in train]
    small_train, small_eval = synthetic_splits(task, seed=11, max_train=10, max_eval=5)
    assert len(small_train) == 10 and len(small_eval) == 5
    assert train[0].source == f"reverse3:{train[0].uid}"


def test_large_space_is_sampled():
    train, evals = synthetic_splits(SyntheticTask("add", 4), seed=0, max_train=100, max_eval=20)
    assert len(train) == 100 and len(evals) == 20
    assert not {r.uid for r in train} & {r.uid for r in evals}


@pytest.mark.parametrize("name, max_new_tokens", [("copy", 3), ("reverse", 4), ("add", 3), ("copy", 8)])
def test_random_policy_formula_matches_monte_carlo(name, max_new_tokens):
    task, tok = make_task(name), builtin_tokenizer()
    exact = random_policy_expected_reward(task, tok, max_new_tokens)
    mean, stderr = random_policy_reward_mc(task, tok, max_new_tokens, get_reward_fn(task.reward), num_samples=6000, seed=1)
    assert abs(exact - mean) < 4 * stderr
    assert 0.03 < exact < 0.06  # ~1/20 per character: far below the 0.9 target


def test_random_policy_formula_hand_value():
    # one answer char, one step: P(char token) * P(right char) = (20/24) * (1/20) = 1/24
    assert random_policy_expected_reward(SyntheticTask("copy", 1), builtin_tokenizer(), 1) == pytest.approx(1 / 24)


def test_bad_task_arguments():
    with pytest.raises(ValueError, match="must be one of"):
        make_task("multiply")
    with pytest.raises(ValueError, match="num_digits=0"):
        SyntheticTask("copy", 0)
    with pytest.raises(IndexError):
        make_task("copy").example(100)
    with pytest.raises(ValueError, match="eval_fraction"):
        synthetic_splits(make_task("copy"), eval_fraction=0.0)
