"""RL math (advantages, losses, mismatch metrics) and verifiable rewards. Pure functions; the trainer loop
that wires them to the model and rollout lives in `jaxrl_fp8.rl.trainer` (not imported here, so that
importing the math stays light and free of cycles)."""

from jaxrl_fp8.rl.advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    grpo_advantages_by_group,
    reinforce_advantages,
    rloo_advantages,
)
from jaxrl_fp8.rl.latex import MathParseError, extract_boxed, normalize_answer, parse_math
from jaxrl_fp8.rl.losses import (
    PolicyLossConfig,
    aggregate,
    approx_kl,
    entropy_from_logits,
    masked_mean,
    policy_loss,
    ppo_clip_loss,
    tis_weights,
)
from jaxrl_fp8.rl.mismatch import (
    mismatch_metrics,
    per_sequence_max_abs_diff,
    tis_clipfrac,
    train_rollout_kl,
    train_rollout_logprob_abs_diff,
)
from jaxrl_fp8.rl.rewards import (
    BUILTIN_REWARDS,
    answers_match,
    compute_rewards,
    exact_match_reward,
    get_reward_fn,
    load_reward_fn,
    math_reward,
    positional_match_reward,
)
