"""Train–rollout mismatch across MoE sizes and precision recipes: the Unified-FP8 claim (one quantization path
for rollout and training removes the mismatch), measured.

For every model size of a Qwen3-MoE sweep and every recipe, on one fixed set of seeded random-token prompts:

1. roll out with the embedded engine under the recipe's ROLLOUT format (`EmbeddedEngine.generate`, routed
   experts returned);
2. recompute the log-probs of the sampled tokens as the trainer does (`rl.batch.build_batch` layout, the
   model's full forward under the recipe's TRAINING `PrecisionPolicy`, `rollout.sampling.token_logprobs`), once
   replaying the rollout's expert selection (R3) and once with the trainer's own routing;
3. score the two with `rl.mismatch.mismatch_metrics` (mean |Δlogp|, K3 KL, TIS clip fraction, max |Δ|) and
   count how often the trainer's own routing picks other experts than the rollout did.

Random weights hide mismatch (near-uniform logits make every log-prob ≈ -log V and quantization noise
invisible). Two scale knobs of a random Qwen3-MoE depend on the hidden size, so they are calibrated per size
before anything is measured (see `calibrate`): every MoE router is rescaled so its logits have a fixed
standard deviation (`--router-logit-std`), and lm_head is rescaled so the mean next-token entropy at
temperature 1 is `--target-entropy` nats. Sizes are then compared at equal peakedness and equal routing
margins. docs/mismatch_study.md explains the choice and what it does not capture.

    python experiments/mismatch_study.py --sizes tiny            # CPU, a few minutes
    python experiments/mismatch_study.py --sizes gpu             # the H200 sweep (tens of M .. a few B params)

Outputs (written to a temp name, then renamed) under experiments/results/mismatch_<device>/:
mismatch.json (everything, incl. settings and calibration), mismatch.md (tables), mismatch_vs_size.png,
r3_vs_no_r3.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Sequence

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RECIPES = ("bf16", "bf16_train_fp8_rollout", "fp8_block", "bf16_train_mxfp8_rollout", "mxfp8", "nvfp4")
METRICS = ("train_rollout_logprob_abs_diff", "train_rollout_kl", "train_rollout_tis_clipfrac")
METRIC_LABELS = {
    "train_rollout_logprob_abs_diff": "mean |logp_train - logp_rollout|",
    "train_rollout_kl": "K3 KL(rollout || train)",
    "train_rollout_tis_clipfrac": "TIS clip fraction",
}


# ------------------------------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class SizeSpec:
    """One Qwen3-MoE shape of the sweep (every layer MoE, untied lm_head, as Qwen3-30B-A3B)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    vocab: int

    def model_config(self, max_positions: int):
        from jaxrl_fp8.model import tiny_config

        return tiny_config(
            vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim, intermediate_size=2 * self.hidden,
            moe_intermediate_size=self.moe_intermediate, num_experts=self.experts, num_experts_per_tok=self.top_k,
            norm_topk_prob=True, mlp_only_layers=(), decoder_sparse_step=1, tie_word_embeddings=False,
            max_position_embeddings=max(512, max_positions),
        )

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters, counted from the shapes (norms included)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 2 * d
        expert = 3 * h * self.moe_intermediate
        per_layer = attn + 2 * h + self.experts * h
        total = 2 * self.vocab * h + h + self.layers * (per_layer + self.experts * expert)
        active = 2 * self.vocab * h + h + self.layers * (per_layer + self.top_k * expert)
        return total, active


def _s(name, hidden, layers, heads, kv, hd, experts, k, inter, vocab):
    return SizeSpec(name, hidden, layers, heads, kv, hd, experts, k, inter, vocab)


# tiny (CI, < 5 min on 2 CPU cores): 0.2M .. 4M parameters, 2 layers each (compile time grows with the layer
# count and dominates on CPU). cpu: 0.2M .. 16M, 2 to 4 layers (about 7 CPU-minutes). Vocab 512.
# gpu: Qwen3-30B-A3B-like proportions (GQA, many experts, top-8 at the large end), vocab 32768 so the embedding
# does not dominate the small sizes; 60M .. 3.7B parameters.
_TINY = (
    _s("moe-0.2M", 64, 2, 4, 2, 16, 4, 2, 64, 512),
    _s("moe-1M", 128, 2, 4, 2, 32, 8, 2, 128, 512),
    _s("moe-4M", 256, 2, 8, 4, 32, 16, 4, 128, 512),
)
SIZE_PRESETS: dict[str, tuple[SizeSpec, ...]] = {
    "tiny": _TINY,
    "cpu": (
        *_TINY[:2],
        _s("moe-6M", 256, 3, 8, 4, 32, 16, 4, 128, 512),
        _s("moe-16M", 384, 4, 8, 4, 48, 32, 4, 96, 512),
    ),
    "gpu": (
        _s("moe-60M", 512, 4, 8, 4, 64, 16, 4, 256, 32768),
        _s("moe-400M", 1024, 8, 16, 4, 64, 32, 4, 384, 32768),
        _s("moe-1.5B", 1536, 12, 16, 4, 128, 64, 8, 384, 32768),
        _s("moe-3.7B", 2048, 16, 32, 4, 128, 64, 8, 512, 32768),
    ),
}
SIZES_BY_NAME = {s.name: s for preset in SIZE_PRESETS.values() for s in preset}


def resolve_sizes(spec: str) -> list[SizeSpec]:
    """`tiny`, `gpu`, or a comma-separated list of size names from the presets."""
    if spec in SIZE_PRESETS:
        return list(SIZE_PRESETS[spec])
    out = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name not in SIZES_BY_NAME:
            raise ValueError(f"--sizes: unknown size {name!r}; use a preset ({', '.join(SIZE_PRESETS)}) or names from "
                             f"{', '.join(SIZES_BY_NAME)}")
        out.append(SIZES_BY_NAME[name])
    if not out:
        raise ValueError("--sizes: no size given")
    return out


def resolve_recipes(names: Sequence[str]):
    from jaxrl_fp8.precision import RECIPES

    out = []
    for name in names:
        if name not in RECIPES:
            raise ValueError(f"--recipes: unknown recipe {name!r}; known: {', '.join(RECIPES)}")
        out.append(RECIPES[name])
    if not out:
        raise ValueError("--recipes: no recipe given")
    return out


# ---------------------------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class StudySettings:
    num_prompts: int = 32
    prompt_len: int = 16
    max_new_tokens: int = 32
    temperature: float = 1.0
    seed: int = 0
    target_entropy: float = 1.0  # nats, mean next-token entropy after calibration
    router_logit_std: float = 1.0
    dtype: str = "float32"  # masters and activations (the trainer's default compute dtype)
    tis_clip_low: float = 0.0
    tis_clip: float = 2.0

    def __post_init__(self):
        for name in ("num_prompts", "prompt_len", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not self.target_entropy > 0:
            raise ValueError(f"--target-entropy must be > 0 nats, got {self.target_entropy}")
        if not self.router_logit_std > 0:
            raise ValueError(f"--router-logit-std must be > 0, got {self.router_logit_std}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.max_new_tokens


def make_prompts(vocab: int, settings: StudySettings) -> list[list[int]]:
    """The fixed prompt set: seeded uniform random tokens (the same ids for every recipe of a size)."""
    rng = np.random.default_rng(settings.seed)
    return rng.integers(0, vocab, size=(settings.num_prompts, settings.prompt_len)).tolist()


# ------------------------------------------------------------------------------------------- calibration


@functools.cache
def _mean_scaled_entropy():
    """jit(mean entropy of softmax(scale * logits)), built once (the bisection calls it 30-odd times)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_fp8.rl.losses import entropy_from_logits

    return jax.jit(lambda logits, scale: jnp.mean(entropy_from_logits(scale * jnp.asarray(logits, jnp.float32))))


def entropy_of_scaled(logits, scale: float) -> float:
    """Mean entropy (nats) of softmax(scale * logits) over the leading axes; logits [..., V] (numpy or a device
    array). Computed on the device in float32: the calibration's 30-odd evaluations over [prompts, positions,
    V] logits (1.3 GB at 128 x 80 x 32768) would take minutes each as float64 numpy on the host."""
    return float(_mean_scaled_entropy()(logits, np.float32(scale)))


def scale_for_entropy(logits, target: float, lo: float = 1e-3, hi: float = 1e5, tol: float = 1e-7, max_iters: int = 200) -> float:
    """The factor c > 0 with mean entropy of softmax(c * logits) == target (bisection on log c until the bracket
    is narrower than `tol`; entropy falls monotonically as c grows). Fails clearly when the target is outside
    what scaling can reach."""
    import jax.numpy as jnp

    logits = jnp.asarray(logits, jnp.float32)
    v = logits.shape[-1]
    if not 0 < target < math.log(v):
        raise ValueError(f"target entropy {target} nats must be in (0, log V = {math.log(v):.3f})")
    h_lo, h_hi = entropy_of_scaled(logits, lo), entropy_of_scaled(logits, hi)
    if not h_hi < target < h_lo:
        raise ValueError(f"target entropy {target} is not reachable by scaling lm_head (range {h_hi:.4f} .. {h_lo:.4f} nats)")
    a, b = math.log(lo), math.log(hi)
    for _ in range(max_iters):
        if b - a < tol:
            break
        mid = 0.5 * (a + b)
        if entropy_of_scaled(logits, math.exp(mid)) > target:
            a = mid
        else:
            b = mid
    return math.exp(0.5 * (a + b))


def _routed_none(batch: int, length: int, cfg) -> np.ndarray:
    """An R3 array that replays nothing: rows of -1 make the model use its own router (see model.moe.route)."""
    return np.full((batch, length, cfg.num_hidden_layers, max(cfg.num_experts_per_tok, 1)), -1, np.int32)


def calibrate(model, prompts: list[list[int]], settings: StudySettings) -> dict:
    """Rescale every MoE router (logit std -> router_logit_std) and lm_head (mean entropy -> target_entropy).

    The entropy is measured with the BF16 training forward on the prompts followed by seeded random tokens,
    at the study's sequence shape, so the program compiled here is the one the BF16 recompute reuses.
    """
    import jax.numpy as jnp

    from jaxrl_fp8.model import Policy
    from jaxrl_fp8.precision import get_recipe

    cfg = model.cfg
    router_scales = []
    for layer in model.layers:
        if hasattr(layer, "moe"):
            w = np.asarray(layer.moe.router.weight.get_value(), np.float64)
            row_norm = float(np.sqrt(np.mean(np.sum(w * w, axis=-1))))  # logit std for unit-RMS inputs
            c = settings.router_logit_std / row_norm
            layer.moe.router.weight.set_value((jnp.asarray(w * c)).astype(layer.moe.router.weight.get_value().dtype))
            router_scales.append(c)
    rng = np.random.default_rng(settings.seed + 1)
    tail = rng.integers(0, cfg.vocab_size, size=(len(prompts), settings.max_new_tokens))
    ids = np.concatenate([np.asarray(prompts, np.int32), tail.astype(np.int32)], axis=1)
    policy = Policy(model, recipe=get_recipe("bf16"))
    # the logits stay on the device: the bisection evaluates the entropy there
    logits = policy.forward(ids, routed_experts=_routed_none(*ids.shape, cfg), precision="train").logits[:, :-1]
    logits = jnp.asarray(logits, jnp.float32) / settings.temperature
    before = entropy_of_scaled(logits, 1.0)
    c = scale_for_entropy(logits, settings.target_entropy)
    head = model.lm_head.weight
    head.set_value((jnp.asarray(np.asarray(head.get_value(), np.float64) * c)).astype(head.get_value().dtype))
    return {
        "router_scale_mean": float(np.mean(router_scales)) if router_scales else None,
        "router_logit_std": settings.router_logit_std,
        "lm_head_scale": c,
        "entropy_before": before,
        "entropy_target": settings.target_entropy,
        "entropy_predicted": entropy_of_scaled(logits, c),
    }


def build_model(spec: SizeSpec, prompts, settings: StudySettings):
    from jaxrl_fp8.model import random_policy

    cfg = spec.model_config(settings.seq_len)
    model = random_policy(cfg, seed=settings.seed, dtype=settings.dtype).model
    return model, calibrate(model, prompts, settings)


# --------------------------------------------------------------------------------------- rollout / score


def rollout(model, recipe, prompts, settings: StudySettings):
    """Samples of the embedded engine under the recipe's rollout format (one chunk, no stop tokens)."""
    from jaxrl_fp8.model import Policy
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine
    from jaxrl_fp8.rollout.types import SamplingParams

    engine = EmbeddedEngine(Policy(model, recipe=recipe), max_batch=len(prompts), max_seq_len=settings.seq_len,
                            seed=settings.seed)
    sp = SamplingParams(temperature=settings.temperature, max_new_tokens=settings.max_new_tokens, seed=settings.seed)
    samples = engine.generate(prompts, sp, return_routed_experts=True)
    del engine
    return samples


def recompute(model, recipe, tokens: np.ndarray, routed: np.ndarray, settings: StudySettings):
    """The trainer's recomputation of old log-probs (rl.trainer: forward in the training format with the
    given routing, then `token_logprobs(logits[:, :-1] / T, tokens[:, 1:])`). Returns (logp [B, L-1],
    the entropy of softmax(logits / T) at each position [B, L-1] (computed on the device: the logits are
    [B, L, V] and never come to the host), the routing the forward used [B, L, layers, k])."""
    import jax.numpy as jnp

    from jaxrl_fp8.model import Policy
    from jaxrl_fp8.rl.losses import entropy_from_logits
    from jaxrl_fp8.rollout.sampling import token_logprobs

    out = Policy(model, recipe=recipe).forward(tokens, routed_experts=routed, precision="train")
    logits = out.logits[:, :-1]
    logp = token_logprobs(logits, jnp.asarray(tokens[:, 1:]), settings.temperature)
    entropy = entropy_from_logits(logits / settings.temperature)
    return np.asarray(logp), np.asarray(entropy), np.asarray(out.routed_experts)


def routing_flip_fraction(rollout_routed: np.ndarray, train_routed: np.ndarray, moe_layers: Sequence[int]) -> float:
    """Share of (position, MoE layer) pairs where the trainer's own top-k expert SET differs from the rollout's.
    Positions the rollout did not route (-1, padding) are skipped."""
    if not moe_layers:
        return 0.0
    a = np.sort(rollout_routed[:, :, list(moe_layers)], axis=-1)
    b = np.sort(train_routed[:, :, list(moe_layers)], axis=-1)
    valid = np.all(a >= 0, axis=-1)
    if not valid.any():
        return 0.0
    differ = np.any(a != b, axis=-1)
    return float(differ[valid].mean())


def score(samples, model, recipe, settings: StudySettings, *, r3: bool) -> dict:
    """Mismatch metrics of one (recipe, R3 on/off) on the given rollout samples."""
    import jax.numpy as jnp

    from jaxrl_fp8.rl.batch import build_batch
    from jaxrl_fp8.rl.mismatch import mismatch_metrics

    cfg = model.cfg
    k = max(cfg.num_experts_per_tok, 1)
    tb = build_batch(samples, np.zeros(len(samples), np.float32), settings.seq_len, 0, num_layers=cfg.num_hidden_layers,
                     top_k=k, with_routing=True)
    # no-R3 feeds an all -1 replay array: the model then routes every row itself (as routed_experts=None would)
    # and the same compiled program serves both variants
    routed_in = tb.routed_experts if r3 else _routed_none(*tb.tokens.shape, cfg)
    logp, entropy, used = recompute(model, recipe, tb.tokens, routed_in, settings)
    mask = tb.response_mask
    mm = {k_: float(v) for k_, v in mismatch_metrics(jnp.asarray(logp), jnp.asarray(tb.rollout_logp), jnp.asarray(mask),
                                                    settings.tis_clip_low, settings.tis_clip).items()}
    delta = (logp - tb.rollout_logp)[mask > 0]
    return {
        **mm,
        "tokens": int(mask.sum()),
        "bitwise_equal_token_frac": float(np.mean(logp[mask > 0].view(np.uint32) == tb.rollout_logp[mask > 0].view(np.uint32))),
        "delta_mean": float(delta.mean()),
        "routing_flip_frac": routing_flip_fraction(tb.routed_experts, used, cfg.moe_layers),
        "train_entropy": float(entropy[mask > 0].astype(np.float64).mean()) if mask.any() else float("nan"),
    }


# ----------------------------------------------------------------------------------------------- driver


def device_name() -> tuple[str, str]:
    """('cpu' | 'h200' | ..., the full device kind) of the default JAX device."""
    import jaxrl_fp8  # noqa: F401  (first: it sets the XLA flags the contract needs before JAX starts a backend)
    import jax

    d = jax.devices()[0]
    if d.platform == "cpu":
        return "cpu", platform.processor() or platform.machine()
    kind = getattr(d, "device_kind", d.platform)
    token = re.findall(r"[a-z]+\d+[a-z]*", kind.lower())
    return (token[-1] if token else re.sub(r"\W+", "_", kind.lower())), kind


def run_study(sizes: Sequence[SizeSpec], recipe_names: Sequence[str], settings: StudySettings, *, progress: bool = True,
              log=print, on_size=None) -> dict:
    """Measure every (size, recipe, R3 on/off). Recipes sharing a rollout format share one rollout (the
    engine's output depends only on the rollout side), so each size rolls out once per rollout format.
    on_size(result so far) runs after each size (the CLI writes its outputs then: a run cut short by a
    device time limit keeps every size it finished)."""
    import jaxrl_fp8  # noqa: F401  (first: it sets the XLA flags the contract needs before JAX starts a backend)
    import jax
    from tqdm import tqdm

    recipes = resolve_recipes(recipe_names)
    t_start = time.time()
    groups: dict[tuple, list] = {}
    for r in recipes:
        groups.setdefault((r.rollout_format, r.pow2_scale, r.four_over_six), []).append(r)
    total = len(sizes) * (len(groups) + 2 * len(recipes))
    bar = tqdm(total=total, desc="mismatch study", disable=not progress, dynamic_ncols=True, file=sys.stderr)
    size_rows, rows = [], []
    for spec in sizes:
        t0 = time.time()
        bar.set_postfix_str(f"{spec.name}: init + calibrate")
        prompts = make_prompts(spec.vocab, settings)
        model, calib = build_model(spec, prompts, settings)
        n_total, n_active = spec.param_counts()
        n_model = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_state(model)))
        if n_model != n_total:
            raise AssertionError(f"{spec.name}: counted {n_total} parameters from the shapes but the model has {n_model}")
        size_rows.append({**dataclasses.asdict(spec), "params_total": n_total, "params_active": n_active, "calibration": calib})
        for key, members in groups.items():
            bar.set_postfix_str(f"{spec.name}: rollout {key[0]}")
            t_roll = time.time()
            samples = rollout(model, members[0], prompts, settings)
            t_roll = time.time() - t_roll
            bar.update(1)
            for recipe in members:
                for r3 in (True, False):
                    bar.set_postfix_str(f"{spec.name}: {recipe.name} {'R3' if r3 else 'no R3'}")
                    t_score = time.time()
                    m = score(samples, model, recipe, settings, r3=r3)
                    rows.append({"size": spec.name, "params_total": n_total, "params_active": n_active, "recipe": recipe.name,
                                 "rollout_format": recipe.rollout_format, "train_format": recipe.train_format,
                                 "unified": recipe.unified, "r3": r3, **m, "rollout_seconds": t_roll,
                                 "score_seconds": time.time() - t_score})
                    bar.update(1)
        log(f"{spec.name}: {n_total / 1e6:.2f}M params, {time.time() - t0:.1f}s")
        del model
        if on_size is not None:
            on_size(_result(size_rows, rows, recipe_names, settings, t_start))
    bar.close()
    return _result(size_rows, rows, recipe_names, settings, t_start)


def _result(size_rows, rows, recipe_names, settings: StudySettings, t_start: float) -> dict:
    import jax

    from jaxrl_fp8.ops.high_precision import effective_form

    dev, kind = device_name()
    return {
        "meta": {
            "device": dev, "device_kind": kind, "jax_version": jax.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runtime_seconds": time.time() - t_start,
            "recipes": list(recipe_names), "settings": dataclasses.asdict(settings),
            "high_precision_form": effective_form(),  # router / lm_head product (ops.high_precision), "auto" resolved
            "weights": "random init (normal 0.02), routers rescaled to router_logit_std, lm_head rescaled to "
                       "target_entropy (see calibrate)",
            "prompts": f"{settings.num_prompts} prompts of {settings.prompt_len} uniform random tokens, numpy seed {settings.seed}",
        },
        "sizes": list(size_rows),
        "results": list(rows),
    }


def _state(model):
    from flax import nnx

    return nnx.state(model)


# ---------------------------------------------------------------------------------------------- outputs


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.2e}"


def markdown(result: dict) -> str:
    meta = result["meta"]
    s = meta["settings"]
    lines = [
        f"# Train–rollout mismatch ({meta['device']}: {meta['device_kind']})",
        "",
        f"{meta['prompts']}; {s['max_new_tokens']} sampled tokens each at temperature {s['temperature']}; "
        f"{meta['weights']}; target entropy {s['target_entropy']} nats, router logit std {s['router_logit_std']}; "
        f"dtype {s['dtype']}; router / lm_head product {meta.get('high_precision_form', 'xla')}; jax {meta['jax_version']}; "
        f"{meta['runtime_seconds']:.0f} s (summed over parts).",
        "",
        "Δ = trainer log-prob − rollout log-prob per sampled token. *exact* = every token bit-identical. "
        "Routing flips: share of (token, MoE layer) where the trainer's own top-k differs from the rollout's "
        "(without R3; with R3 the rollout's selection is replayed, so 0 by construction).",
        "",
        "## Sizes",
        "",
        "| size | params (total) | params (active) | layers | hidden | experts (top-k) | lm_head scale | entropy before → after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for z in result["sizes"]:
        c = z["calibration"]
        lines.append(f"| {z['name']} | {z['params_total'] / 1e6:.2f}M | {z['params_active'] / 1e6:.2f}M | {z['layers']} | "
                     f"{z['hidden']} | {z['experts']} ({z['top_k']}) | {c['lm_head_scale']:.1f} | "
                     f"{c['entropy_before']:.2f} → {c['entropy_predicted']:.2f} |")
    lines += ["", "## Mismatch", "",
              "| size | recipe | rollout / train | R3 | mean abs Δ | K3 KL | TIS clipfrac | max abs Δ | exact | routing flips |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        exact = "yes" if r["bitwise_equal_token_frac"] == 1.0 else f"{100 * r['bitwise_equal_token_frac']:.0f}%"
        flips = "—" if r["r3"] else _fmt(r["routing_flip_frac"])
        lines.append(f"| {r['size']} | {r['recipe']} | {r['rollout_format']} / {r['train_format']} | {'on' if r['r3'] else 'off'} | "
                     f"{_fmt(r['train_rollout_logprob_abs_diff'])} | {_fmt(r['train_rollout_kl'])} | "
                     f"{_fmt(r['train_rollout_tis_clipfrac'])} | {_fmt(r['train_rollout_max_abs_diff'])} | {exact} | {flips} |")
    return "\n".join(lines) + "\n"


def _recipe_style(names: Sequence[str]):
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {n: colors[i % len(colors)] for i, n in enumerate(names)}


def _save(fig, path: str) -> None:
    tmp = path[: -len(".png")] + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def plot_vs_size(result: dict, path: str) -> None:
    """One panel per metric against total parameters, a line per recipe (solid R3, dashed no R3), plus the
    routing-flip rate without R3. Linear y axes; recipes that are exactly 0 at every size are listed in the panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = result["results"]
    sizes = result["sizes"]
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    color = _recipe_style(recipes)
    panels = [(m, METRIC_LABELS[m], (True, False)) for m in METRICS]
    panels.append(("routing_flip_frac", "routing flips without R3 (share of token x MoE layer)", (False,)))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 5.0))
    for ax, (metric, title, r3_values) in zip(axes, panels):
        zero = []
        for recipe in recipes:
            vals = [r[metric] for r in rows if r["recipe"] == recipe and r["r3"] in r3_values]
            if vals and all(v == 0 for v in vals):
                zero.append(recipe)
                continue
            for r3 in r3_values:
                pts = sorted((r["params_total"], r[metric]) for r in rows if r["recipe"] == recipe and r["r3"] == r3)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "-" if r3 else "--", marker="o", ms=4,
                            color=color[recipe], label=f"{recipe} ({'R3' if r3 else 'no R3'})")
        ax.set_xscale("log")
        ax.set_xticks([z["params_total"] for z in sizes], [f"{z['name']}\n{z['params_total'] / 1e6:.3g}M" for z in sizes], fontsize=7)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_ylim(bottom=0)
        if zero:
            ax.text(0.98, 0.02, "exactly 0 at every size:\n" + "\n".join(zero), transform=ax.transAxes, fontsize=7,
                    ha="right", va="bottom", bbox=dict(facecolor="white", alpha=0.8, edgecolor="0.8"))
        ax.set_xlabel("total parameters")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.suptitle(f"Train-rollout mismatch vs MoE size ({result['meta']['device']}); solid: with R3, dashed: without",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    _save(fig, path)
    plt.close(fig)


def plot_r3(result: dict, path: str) -> None:
    """Mean |Δlogp| with and without R3, per recipe, one panel per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(3.6 * len(sizes) + 1, 4.2), squeeze=False, sharey=True)
    x = np.arange(len(recipes))
    for ax, size in zip(axes[0], sizes):
        for j, (r3, label) in enumerate(((True, "R3"), (False, "no R3"))):
            vals = [next((r["train_rollout_logprob_abs_diff"] for r in rows if r["size"] == size and r["recipe"] == rec
                          and r["r3"] == r3), np.nan) for rec in recipes]
            bars = ax.bar(x + (j - 0.5) * 0.38, vals, 0.38, label=label, color="tab:blue" if r3 else "tab:orange")
            for bar, v in zip(bars, vals):
                if v == 0:
                    ax.text(bar.get_x() + bar.get_width() / 2, 0, "0", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, recipes, rotation=60, ha="right", fontsize=7)
        ax.set_title(size, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("mean |logp_train - logp_rollout|")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Routing replay (R3) vs the trainer's own routing ({result['meta']['device']})", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _recipe_order(names: Sequence[str]) -> list[str]:
    known = {r: i for i, r in enumerate(DEFAULT_RECIPES)}
    first = {r: i for i, r in enumerate(names)}
    return sorted(set(names), key=lambda r: (known.get(r, len(known)), first[r]))


def merge_results(old: dict, new: dict) -> dict:
    """`old` and `new` as one result: a sweep split over several runs (one per device command, or sizes and
    recipe groups run by separate processes at once). Settings and device must match; a (size, recipe) that
    `new` measured replaces `old`'s rows, everything else is kept. Recipes are the union, in the study's order."""
    for key in ("settings", "device", "high_precision_form"):  # results from before the form was recorded: "xla"
        a, b = old["meta"].get(key, "xla"), new["meta"].get(key, "xla")
        if a != b:
            raise ValueError(f"merge: the results differ in {key} ({a!r} vs {b!r}); use another --out or rerun every size")
    by_name = {z["name"]: z for z in old["sizes"]}
    by_name.update({z["name"]: z for z in new["sizes"]})
    sizes = sorted(by_name.values(), key=lambda z: z["params_total"])
    recipes = _recipe_order(list(old["meta"]["recipes"]) + list(new["meta"]["recipes"]))
    fresh = {(r["size"], r["recipe"]) for r in new["results"]}
    rows = [r for r in old["results"] if (r["size"], r["recipe"]) not in fresh] + new["results"]
    size_at = {z["name"]: i for i, z in enumerate(sizes)}
    recipe_at = {r: i for i, r in enumerate(recipes)}
    rows.sort(key=lambda r: (size_at[r["size"]], recipe_at.get(r["recipe"], len(recipe_at))))  # stable: R3 order kept
    meta = dict(new["meta"], recipes=recipes,
                runtime_seconds=old["meta"]["runtime_seconds"] + new["meta"]["runtime_seconds"])
    return {"meta": meta, "sizes": sizes, "results": rows}


def write_outputs(result: dict, out_dir: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("mismatch.json", "mismatch.md", "mismatch_vs_size.png", "r3_vs_no_r3.png")}
    for name, text in (("mismatch.json", json.dumps(result, indent=1) + "\n"), ("mismatch.md", markdown(result))):
        tmp = paths[name] + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, paths[name])
    plot_vs_size(result, paths["mismatch_vs_size.png"])
    plot_r3(result, paths["r3_vs_no_r3.png"])
    return paths


# -------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = StudySettings()
    p = argparse.ArgumentParser(
        prog="python experiments/mismatch_study.py",
        description="Measure train-rollout log-prob mismatch (mean |Δ|, K3 KL, TIS clip fraction, routing flips) over "
                    "Qwen3-MoE sizes x precision recipes, with and without routing replay (R3). Writes JSON, a markdown "
                    "table and PNG plots.",
    )
    p.add_argument("--sizes", default="tiny",
                   help=f"a preset ({', '.join(f'{k}: ' + ' '.join(s.name for s in v) for k, v in SIZE_PRESETS.items())}) "
                        "or a comma-separated list of those size names (default: tiny)")
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                   help="comma-separated recipe names from jaxrl_fp8.precision.RECIPES (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="prompts in the fixed set (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="tokens per prompt (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="tokens sampled per prompt; no stop tokens, so every row samples exactly this many (default %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling and recompute temperature (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of weights, prompts and sampling (default %(default)s)")
    p.add_argument("--target-entropy", type=float, default=d.target_entropy,
                   help="mean next-token entropy (nats) lm_head is calibrated to (default %(default)s)")
    p.add_argument("--router-logit-std", type=float, default=d.router_logit_std,
                   help="std of every MoE router's logits after calibration (default %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype,
                   help="master/activation dtype of model, engine and recompute (default %(default)s)")
    p.add_argument("--tis-clip", type=float, default=d.tis_clip, help="TIS upper clip for the clip fraction (default %(default)s)")
    p.add_argument("--tis-clip-low", type=float, default=d.tis_clip_low, help="TIS lower clip (default %(default)s)")
    p.add_argument("--out", default=None,
                   help="output directory (default: experiments/results/mismatch_<device>/)")
    p.add_argument("--append", action="store_true",
                   help="merge into an existing mismatch.json in --out (same settings): the (size, recipe) pairs measured now "
                        "replace theirs, the others are kept; for sweeps split over several runs")
    p.add_argument("--merge", default=None, metavar="DIR,DIR,...",
                   help="measure nothing: merge the mismatch.json of these directories (sizes run by separate processes, "
                        "same settings and recipes) and write the outputs to --out")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX persistent compilation cache directory (reruns and split sweeps skip recompiling)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _merge_dirs(dirs: Sequence[str], out: str) -> int:
    merged = None
    for d in dirs:
        path = os.path.join(d, "mismatch.json")
        if not os.path.isfile(path):
            raise ValueError(f"--merge: {path} does not exist")
        with open(path) as f:
            part = json.load(f)
        merged = part if merged is None else merge_results(merged, part)
    for path in write_outputs(merged, out).values():
        print(path)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = resolve_sizes(args.sizes)
        recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
        resolve_recipes(recipes)
        settings = StudySettings(num_prompts=args.num_prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, seed=args.seed, target_entropy=args.target_entropy,
                                 router_logit_std=args.router_logit_std, dtype=args.dtype, tis_clip_low=args.tis_clip_low,
                                 tis_clip=args.tis_clip)
        if args.merge:
            if not args.out:
                raise ValueError("--merge needs --out")
            return _merge_dirs([d.strip() for d in args.merge.split(",") if d.strip()], args.out)
        out = args.out or os.path.join(HERE, "results", f"mismatch_{device_name()[0]}")
        previous = None
        if args.append and os.path.exists(os.path.join(out, "mismatch.json")):
            with open(os.path.join(out, "mismatch.json")) as f:
                previous = json.load(f)
            if previous["meta"]["settings"] != dataclasses.asdict(settings):
                raise ValueError(f"--append: {out}/mismatch.json was measured with other settings "
                                 f"({previous['meta']['settings']!r})")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.compile_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", os.path.abspath(args.compile_cache))
    def save(result):
        return write_outputs(merge_results(previous, result) if previous is not None else result, out)

    result = run_study(sizes, recipes, settings, progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr),
                       on_size=save)
    for path in save(result).values():
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
