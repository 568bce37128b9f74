"""BF16 training with FP8 rollout (the seed's lowest-friction mode): quantization mismatch is real here and is
what train_rollout_logprob_abs_diff / train_rollout_kl measure; TIS corrects for it."""

from jaxrl_fp8.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/qwen3_4b_bf16_train_fp8_rollout"
    c.recipe = "bf16_train_fp8_rollout"
    c.hardware = "hopper"
    c.model.checkpoint = "/models/Qwen3-4B"
    c.model.dtype = "bfloat16"
    c.data.source = "jsonl"
    c.data.path = "/data/dapo-math-17k.jsonl"
    c.data.reward = "math"
    c.data.prompts_per_step = 32
    c.data.max_prompt_tokens = 1024
    c.rollout.n_samples = 8
    c.rollout.max_new_tokens = 4096
    c.rollout.routing_replay = False  # dense model
    c.rl.use_tis = True
    c.rl.learning_rate = 1e-6
    c.rl.num_minibatches = 4
    return c
