"""CPU default: a tiny Qwen3-MoE trained from scratch with unified block-FP8 on a built-in task.

python -m jaxrl_fp8.train --config=experiments/configs/tiny.py
Nothing is downloaded: the model is randomly initialised and the task ships with the package.
"""

from jaxrl_fp8.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/tiny"
    c.recipe = "fp8_block"  # unified: rollout and training forward both block-FP8 (CPU: the contract's XLA path)
    c.total_steps = 160
    # Seeds 0-2 on a 2-core AMD EPYC host (reward = 20-step mean): all pass 0.9, at steps 73-103, and end at
    # 0.879-0.997. With 8 samples and no KL stalled runs had whole groups agree on repeating the first digit
    # ("45=" -> "4444"), which leaves no advantage. Table and diagnosis: docs/decisions/0010.
    c.seed = 0
    c.model.hidden_size = 128  # multiple of 128, so FP8 blocks are full
    c.model.num_hidden_layers = 2
    c.model.num_attention_heads = 4
    c.model.num_key_value_heads = 2
    c.model.head_dim = 32
    c.model.num_experts = 4
    c.model.num_experts_per_tok = 2
    c.model.moe_intermediate_size = 128
    c.model.intermediate_size = 256
    c.data.task = "copy"
    c.data.num_digits = 2
    c.data.prompts_per_step = 32
    c.data.max_prompt_tokens = 8  # prompts are BOS + 2 digits + "=": short sequences, fast steps
    c.rollout.n_samples = 16  # 8 let whole groups agree on a wrong digit (advantage 0, no signal) too often
    c.rollout.max_new_tokens = 4
    c.rl.learning_rate = 1e-3  # 3e-3 collapses entropy before the second digit is learned (measured)
    c.rl.num_minibatches = 2
    # KL to the initial (near-uniform) policy: where a group has no reward variance it is the only gradient, and it
    # lifts the probability of the other digits again until a sample differs (decision 0010: entropy bonus slower)
    c.rl.kl_coef = 0.01
    c.rl.kl_type = "low_var_kl"
    c.rl.warmup_steps = 0
    c.rl.grad_clip = 1.0
    c.checkpoint.every_steps = 40
    c.logging.eval_every_steps = 40
    return c
