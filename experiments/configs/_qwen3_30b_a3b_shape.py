"""Shared by the `qwen3_30b_a3b_shape_*` configs (not a config itself): the Qwen3-30B-A3B architecture with
RANDOM weights (nothing is downloaded), a synthetic long-prompt copy task, the embedded engine collocated on an
expert-parallel training mesh of 8 devices, TIS on. Only the recipe differs between the three configs.

Sizes (`size`):
- "full": the real shape (48 layers, hidden 2048, 128 experts top-8, expert intermediate 768, 32 query / 4 KV
  heads of 128, vocab 151936; about 30.5B parameters), 256-token prompts and 512-token responses, for
  nvidia-h200-x8 (command in docs/decisions/0011-scale-run.md).
- "tiny": the same family scaled down for 8 virtual CPU devices (2 layers, hidden 128, 16 experts top-4,
  vocab 2048, 32 + 32 tokens); the mesh is the same (expert=8).

Why this task: the loop's cost is set by the sequence lengths, not by what the tokens mean. 256 prompt / 512
response tokens is the order of a short math RL prompt and a capped answer, and a random policy over 151936 ids
almost never samples EOS (p ~ 7e-6 a token), so every response runs to `max_new_tokens`: each step has the same
token count, which makes steps comparable. The prompts are `<digits>=` for the built-in character tokenizer
(`copy`: reward = positional match of the digits); the model's vocabulary is padded past the tokenizer's 24 ids
(`model.vocab_size`), and sampled ids past them decode to nothing. The JSONL + tokenizer files are committed
under experiments/configs/data/ (small) so the configs validate anywhere; `write_dataset` regenerates them.
"""

from __future__ import annotations

import json
import os

from jaxrl_fp8.config import as_benchmark_run, base_config

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
RECIPES = ("bf16", "bf16_train_fp8_rollout", "fp8_block")
SIZES = {
    # architecture, then prompt / response tokens and batch
    "full": dict(num_hidden_layers=48, hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                 intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                 rope_theta=1_000_000.0, prompt_tokens=256, response_tokens=512, prompts_per_step=16, n_samples=4,
                 num_minibatches=8, steps=4),
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                 intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=2048,
                 rope_theta=1_000_000.0, prompt_tokens=32, response_tokens=32, prompts_per_step=4, n_samples=4,
                 num_minibatches=2, steps=3),
}
NUM_PROMPTS = 64  # records per dataset file (the loader repeats epochs)


def dataset_path(prompt_tokens: int) -> str:
    return os.path.join(DATA, f"scale_copy_p{prompt_tokens}.jsonl")


def tokenizer_dir() -> str:
    return os.path.join(DATA, "builtin_tokenizer")


def write_dataset(prompt_tokens: int, num_prompts: int = NUM_PROMPTS, seed: int = 0) -> str:
    """`<digits>=` prompts of exactly `prompt_tokens` tokens with the built-in tokenizer (BOS + digits + '='),
    label = the digits; and the built-in tokenizer saved next to them. Deterministic; temp file + rename."""
    import numpy as np

    from jaxrl_fp8.data.builtin_tokenizer import builtin_tokenizer

    os.makedirs(DATA, exist_ok=True)
    builtin_tokenizer().save(tokenizer_dir())
    rng = np.random.default_rng(seed)
    path = dataset_path(prompt_tokens)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for _ in range(num_prompts):
            digits = "".join(map(str, rng.integers(0, 10, prompt_tokens - 2)))
            f.write(json.dumps({"prompt": digits + "=", "label": digits}) + "\n")
    os.replace(tmp, path)
    return path


def shape_config(recipe: str, size: str = "full"):
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: the scale run compares {', '.join(RECIPES)}")
    if size not in SIZES:
        raise ValueError(f"size {size!r}: choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    c = base_config()
    c.workdir = f"runs/qwen3_30b_a3b_shape_{size}_{recipe}"
    c.recipe = recipe
    c.hardware = "auto"  # the tiny size runs on CPU; on H200 this resolves to hopper (fp8_block native)
    c.total_steps = s["steps"]
    m = c.model
    m.checkpoint = ""  # random init
    m.dtype = "bfloat16"
    for key in ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rope_theta"):
        m[key] = s[key]
    m.decoder_sparse_step = 1
    m.mlp_only_layers = ()  # every layer MoE, as Qwen3-30B-A3B
    m.norm_topk_prob = True
    m.tie_word_embeddings = False
    c.data.source = "jsonl"
    c.data.path = dataset_path(s["prompt_tokens"])
    c.data.tokenizer = tokenizer_dir()
    c.data.reward = "positional_match"
    c.data.prompts_per_step = s["prompts_per_step"]
    c.data.max_prompt_tokens = s["prompt_tokens"]
    c.rollout.engine = "embedded"
    c.rollout.placement = "collocated"  # the engine on the training mesh, weights pushed by reference
    c.rollout.n_samples = s["n_samples"]
    c.rollout.max_new_tokens = s["response_tokens"]
    c.rollout.routing_replay = True  # R3
    c.rl.use_tis = True
    c.rl.tis_clip = 2.0
    c.rl.learning_rate = 1e-6
    # minibatch = prompts_per_step * n_samples / num_minibatches = 8 rows: one row per device on the 8-device mesh
    c.rl.num_minibatches = s["num_minibatches"]
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, 1, 8, 1  # dense weights ZeRO-3 over the expert axis
    return as_benchmark_run(c)  # a benchmark: ~370 GB of masters + Adam state would go to disk for nothing
