"""Built-in verifiable tasks for the CPU default: a randomly initialized policy must learn them by RL alone,
in minutes, with no download. So responses are short (a few characters), prompts have a fixed length per
task (fixed positions are easy for attention to learn), and the reward is dense: `positional_match` gives
credit per answer character reproduced at its position.

Tasks, in order of difficulty (k = `num_digits`):
- `copy`:    `"37="`     → `"37"`     (repeat the k digits)
- `reverse`: `"123<"`    → `"321"`    (k digits backwards)
- `add`:     `"3+4="`    → `"07"`     (k-digit operands zero-padded, sum zero-padded to k+1 digits)

Every prompt of a task is an index into its finite space (10^k or 10^2k items), so the train/eval split is
a seeded permutation of indices: deterministic, disjoint, and the same on every process.

Random-policy level: for a policy that samples uniformly over the whole vocabulary, stops at a stop token
and otherwise emits one character or (for the other special tokens) nothing, `random_policy_expected_reward`
computes the expected reward exactly by dynamic programming over the number of emitted characters; a
Monte-Carlo estimate with the real reward function (`random_policy_reward_mc`) cross-checks it in tests.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_fp8.data.records import PromptRecord
from jaxrl_fp8.data.tokenizer import TextTokenizer

__all__ = [
    "SyntheticTask",
    "TASK_NAMES",
    "make_task",
    "synthetic_splits",
    "random_policy_expected_reward",
    "random_policy_reward_mc",
]

TASK_NAMES = ("copy", "reverse", "add")
_DEFAULT_DIGITS = {"copy": 2, "reverse": 3, "add": 1}
_MAX_ENUMERATE = 1_000_000


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    name: str
    num_digits: int
    reward: str = "positional_match"  # a name for `jaxrl_fp8.rl.rewards.get_reward_fn`

    def __post_init__(self):
        if self.name not in TASK_NAMES:
            raise ValueError(f"synthetic task {self.name!r} must be one of {TASK_NAMES}")
        if not 1 <= self.num_digits <= 9:
            raise ValueError(f"synthetic task {self.name}: num_digits={self.num_digits} must be in [1, 9]")

    @property
    def space_size(self) -> int:
        return 10 ** (2 * self.num_digits) if self.name == "add" else 10**self.num_digits

    @property
    def answer_length(self) -> int:
        return self.num_digits + 1 if self.name == "add" else self.num_digits

    @property
    def prompt_length(self) -> int:
        """Characters in every prompt (without BOS)."""
        return 2 * self.num_digits + 2 if self.name == "add" else self.num_digits + 1

    @property
    def max_reward(self) -> float:
        return 1.0

    def example(self, index: int) -> tuple[str, str]:
        """The `(prompt, answer)` at `index` in `[0, space_size)`."""
        if not 0 <= index < self.space_size:
            raise IndexError(f"{self.name}: index {index} outside [0, {self.space_size})")
        k = self.num_digits
        if self.name == "add":
            a, b = divmod(index, 10**k)
            return f"{a:0{k}d}+{b:0{k}d}=", f"{a + b:0{k + 1}d}"
        digits = f"{index:0{k}d}"
        if self.name == "copy":
            return f"{digits}=", digits
        return f"{digits}<", digits[::-1]

    def record(self, index: int) -> PromptRecord:
        prompt, answer = self.example(index)
        return PromptRecord(uid=index, prompt=prompt, answer=answer, source=f"{self.name}{self.num_digits}:{index}")


def make_task(name: str, num_digits: int | None = None) -> SyntheticTask:
    """A task with its default size (copy: 2 digits, reverse: 3, add: 1) unless `num_digits` is given."""
    if name not in TASK_NAMES:
        raise ValueError(f"synthetic task {name!r} must be one of {TASK_NAMES}")
    return SyntheticTask(name, _DEFAULT_DIGITS[name] if num_digits is None else num_digits)


def synthetic_splits(
    task: SyntheticTask,
    *,
    seed: int = 0,
    eval_fraction: float = 0.1,
    max_train: int | None = None,
    max_eval: int | None = None,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Disjoint train/eval records, a seeded permutation of the task's index space."""
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    size = task.space_size
    n_eval = max(1, int(round(size * eval_fraction)))
    n_train = size - n_eval
    if max_eval is not None:
        n_eval = min(n_eval, max_eval)
    if max_train is not None:
        n_train = min(n_train, max_train)
    if size <= _MAX_ENUMERATE:
        order = rng.permutation(size)
        eval_idx, train_idx = order[:n_eval], order[size - n_train:] if n_train else order[:0]
    else:
        chosen = rng.choice(size, size=n_eval + n_train, replace=False)
        eval_idx, train_idx = chosen[:n_eval], chosen[n_eval:]
    return [task.record(int(i)) for i in train_idx], [task.record(int(i)) for i in eval_idx]


def _token_classes(tokenizer: TextTokenizer) -> tuple[int, int, int]:
    """(#stop tokens, #silent tokens, #one-character tokens) of the vocabulary."""
    stops = set(tokenizer.stop_ids)
    silent = chars = 0
    for i in range(tokenizer.vocab_size):
        if i in stops:
            continue
        text = tokenizer.decode([i])
        if text == "":
            silent += 1
        elif len(text) == 1:
            chars += 1
        else:
            raise ValueError(f"token {i} decodes to {text!r}: the exact random-policy formula needs a "
                             "character-level tokenizer")
    return len(stops), silent, chars


def random_policy_expected_reward(task: SyntheticTask, tokenizer: TextTokenizer, max_new_tokens: int) -> float:
    """Exact expected `positional_match` reward of the uniform random policy (see module doc)."""
    if task.reward != "positional_match":
        raise ValueError(f"the exact formula covers positional_match only, not {task.reward!r}")
    n_stop, n_silent, n_char = _token_classes(tokenizer)
    vocab = n_stop + n_silent + n_char
    p_char, p_silent = n_char / vocab, n_silent / vocab
    length = task.answer_length
    # alive[c] = P(not stopped yet, c characters emitted), c capped at `length`; final[c] = P(ended with c).
    final = np.zeros(length + 1)
    alive = np.zeros(length + 1)
    alive[0] = 1.0
    for _ in range(max_new_tokens):
        final += alive * (n_stop / vocab)
        nxt = alive * p_silent
        nxt[1:] += alive[:-1] * p_char
        nxt[length] += alive[length] * p_char
        alive = nxt
    final += alive
    at_least = np.cumsum(final[::-1])[::-1]  # at_least[c] = P(count >= c)
    return float(sum(at_least[j + 1] for j in range(length)) / (length * n_char))


def random_policy_reward_mc(
    task: SyntheticTask, tokenizer: TextTokenizer, max_new_tokens: int, reward_fn, num_samples: int = 20000,
    seed: int = 0,
) -> tuple[float, float]:
    """Monte-Carlo `(mean, standard error)` of `reward_fn(prompt, response, answer)` (the task's reward, e.g.
    `rl.rewards.get_reward_fn(task.reward)`: passed in because `data` imports nothing of ours) under the uniform
    random policy."""
    rng = np.random.default_rng(seed)
    stops = set(tokenizer.stop_ids)
    examples = rng.integers(0, task.space_size, size=num_samples)
    tokens = rng.integers(0, tokenizer.vocab_size, size=(num_samples, max_new_tokens))
    values = np.empty(num_samples)
    for n in range(num_samples):
        prompt, answer = task.example(int(examples[n]))
        ids = []
        for t in tokens[n]:
            if int(t) in stops:
                break
            ids.append(int(t))
        values[n] = reward_fn(prompt, tokenizer.decode(ids), answer)
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(num_samples))
