"""BF16 training with FP8 rollout (the lowest-friction mode: SGLang serves FP8 weights, the trainer keeps BF16): quantization mismatch is real here and is
what train_rollout_logprob_abs_diff / train_rollout_kl measure; TIS corrects for it."""

from jaxrl_fp8.config import math_rl_config


def get_config():
    # Qwen3-4B is dense: nothing to replay.
    return math_rl_config(workdir="runs/qwen3_4b_bf16_train_fp8_rollout", recipe="bf16_train_fp8_rollout",
                          checkpoint="/models/Qwen3-4B", hardware="hopper", routing_replay=False)
