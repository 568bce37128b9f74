"""experiments/mismatch_study.py: the mismatch ordering on the smallest size (unified recipe exactly 0, the mixed
BF16-train / FP8-rollout recipe > 0), its outputs, and its pure pieces (entropy calibration, parameter counts,
routing-flip count, CLI validation). One rollout + two recompute programs compile (~30 s on 2 idle cores)."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxrl_fp8  # noqa: F401  (before anything starts a JAX backend: it sets the contract's XLA flags)

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


study = _load("mismatch_study")
SETTINGS = study.StudySettings(num_prompts=4, prompt_len=8, max_new_tokens=8, seed=3)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    smallest = study.SIZE_PRESETS["tiny"][0]
    partial = []
    res = study.run_study([smallest], ["fp8_block", "bf16_train_fp8_rollout"], SETTINGS, progress=False, log=lambda m: None,
                          on_size=partial.append)
    # the per-size callback (the CLI saves there) saw the finished size with all its rows
    assert len(partial) == 1 and partial[0]["sizes"] == res["sizes"] and partial[0]["results"] == res["results"]
    paths = study.write_outputs(res, str(tmp_path_factory.mktemp("study")))
    return res, paths


def _row(res, recipe, r3):
    rows = [r for r in res["results"] if r["recipe"] == recipe and r["r3"] == r3]
    assert len(rows) == 1, rows
    return rows[0]


def test_unified_is_exactly_zero_and_mixed_is_not(result):
    res, _ = result
    assert len(res["results"]) == 4
    for r3 in (True, False):
        uni, mixed = _row(res, "fp8_block", r3), _row(res, "bf16_train_fp8_rollout", r3)
        for row in (uni, mixed):
            assert row["tokens"] == SETTINGS.num_prompts * SETTINGS.max_new_tokens
        # the embedded engine is bitwise with the trainer's recompute in a unified recipe: every token, every metric
        assert uni["bitwise_equal_token_frac"] == 1.0
        for key in ("train_rollout_logprob_abs_diff", "train_rollout_kl", "train_rollout_tis_clipfrac", "train_rollout_max_abs_diff"):
            assert uni[key] == 0.0, (r3, key, uni[key])
        assert uni["routing_flip_frac"] == 0.0
        # BF16 training against an FP8 rollout: a real mismatch on (nearly) every token
        assert mixed["train_rollout_logprob_abs_diff"] > 0 and mixed["train_rollout_kl"] > 0
        assert mixed["bitwise_equal_token_frac"] < 0.5
        assert mixed["unified"] is False and uni["unified"] is True
    # with R3 the trainer uses the rollout's experts: no routing flips are possible
    assert _row(res, "bf16_train_fp8_rollout", True)["routing_flip_frac"] == 0.0


def test_same_rollout_shared_by_recipes_of_one_rollout_format(result):
    res, _ = result
    # both recipes roll out in fp8-block: one rollout, so the same tokens and the same rollout time
    assert _row(res, "fp8_block", True)["rollout_seconds"] == _row(res, "bf16_train_fp8_rollout", False)["rollout_seconds"]


def test_calibration_reached_target(result):
    res, _ = result
    (size,) = res["sizes"]
    calib = size["calibration"]
    assert abs(calib["entropy_predicted"] - SETTINGS.target_entropy) < 1e-6
    assert calib["entropy_before"] > 5.0  # random init: near log(512) = 6.24
    # the entropy the trainer actually saw at the sampled positions is near the target (other positions / tokens)
    assert 0.3 < _row(res, "fp8_block", True)["train_entropy"] < 2.0


def test_outputs(result):
    res, paths = result
    assert set(paths) == {"mismatch.json", "mismatch.md", "mismatch_vs_size.png", "r3_vs_no_r3.png"}
    assert json.loads(Path(paths["mismatch.json"]).read_text()) == json.loads(json.dumps(res))
    md = Path(paths["mismatch.md"]).read_text()
    assert "| moe-0.2M | fp8_block | fp8-block / fp8-block | on | 0 | 0 | 0 | 0 | yes |" in md
    assert md.count("| moe-0.2M | bf16_train_fp8_rollout |") == 2
    for png in ("mismatch_vs_size.png", "r3_vs_no_r3.png"):
        data = Path(paths[png]).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(Path(paths["mismatch.json"]).parent.glob("*.tmp*"))


def test_scale_for_entropy():
    logits = np.random.default_rng(0).normal(size=(6, 5, 300)).astype(np.float32)
    def entropy64(c):  # float64 numpy statement of the mean entropy the study computes in float32 on the device
        z = c * logits.astype(np.float64)
        z -= z.max(axis=-1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
        return float(np.mean(-np.sum(p * np.log(np.maximum(p, 1e-300)), axis=-1)))

    for target in (0.2, 1.0, 4.0):
        c = study.scale_for_entropy(logits, target)
        assert abs(study.entropy_of_scaled(logits, c) - target) < 1e-5
        assert abs(entropy64(c) - target) < 1e-5
    assert study.entropy_of_scaled(logits, 0.0) == pytest.approx(np.log(300))
    with pytest.raises(ValueError, match="log V"):
        study.scale_for_entropy(logits, 6.0)
    with pytest.raises(ValueError, match="not reachable"):
        study.scale_for_entropy(np.zeros((2, 300), np.float32), 1.0)  # flat logits: scaling cannot sharpen them


def test_param_counts_match_the_model_for_every_preset():
    from jaxrl_fp8.model.qwen3 import Qwen3  # first: jaxrl_fp8 sets XLA flags before JAX starts a backend

    import jax
    from flax import nnx

    for preset, (lo, hi) in (("tiny", (1e5, 2e7)), ("gpu", (1e7, 5e9))):
        specs = study.SIZE_PRESETS[preset]
        assert len(specs) >= (3 if preset == "tiny" else 4)
        totals = []
        for spec in specs:
            cfg = spec.model_config(64)
            abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))  # shapes only: no 3.7B allocation
            n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))
            total, active = spec.param_counts()
            assert n == total, (spec.name, n, total)
            assert active < total
            totals.append(total)
        assert totals == sorted(totals) and lo <= totals[0] and totals[-1] <= hi, (preset, totals)


def test_routing_flip_fraction():
    a = np.array([[[[0, 1], [-1, -1], [2, 3]], [[4, 5], [-1, -1], [6, 7]]]])  # [B=1, L=2, layers=3, k=2]
    same_sets = a[..., ::-1].copy()  # order within top-k does not matter
    assert study.routing_flip_fraction(a, same_sets, [0, 2]) == 0.0
    b = a.copy()
    b[0, 1, 2] = [6, 1]
    assert study.routing_flip_fraction(a, b, [0, 2]) == 0.25
    padded = a.copy()
    padded[0, 1] = -1  # a position the rollout never routed is skipped
    assert study.routing_flip_fraction(padded, b, [0, 2]) == 0.0
    assert study.routing_flip_fraction(a, b, []) == 0.0


def test_merge_results_replaces_remeasured_sizes_and_keeps_the_rest():
    def part(sizes, tag, runtime):
        meta = {"settings": {"seed": 0}, "recipes": ["bf16"], "device": "cpu", "runtime_seconds": runtime}
        return {"meta": meta, "sizes": [{"name": n, "params_total": p} for n, p in sizes],
                "results": [{"size": n, "recipe": "bf16", "tag": tag} for n, _ in sizes]}

    old = part([("a", 1), ("c", 3)], "old", 10.0)
    new = part([("b", 2), ("c", 3)], "new", 5.0)
    merged = study.merge_results(old, new)
    assert [z["name"] for z in merged["sizes"]] == ["a", "b", "c"]
    assert [(r["size"], r["tag"]) for r in merged["results"]] == [("a", "old"), ("b", "new"), ("c", "new")]
    assert merged["meta"]["runtime_seconds"] == 15.0
    # a size split by recipe over two processes: rows of both recipes, the union of recipes in the study's order
    other = part([("b", 2)], "group", 1.0)
    other["meta"]["recipes"] = ["fp8_block"]
    for r in other["results"]:
        r["recipe"] = "fp8_block"
    both = study.merge_results(other, merged)
    assert both["meta"]["recipes"] == ["bf16", "fp8_block"]
    assert [(r["size"], r["recipe"], r["tag"]) for r in both["results"]] == [
        ("a", "bf16", "old"), ("b", "bf16", "new"), ("b", "fp8_block", "group"), ("c", "bf16", "new")]
    other["meta"]["settings"] = {"seed": 1}
    with pytest.raises(ValueError, match="differ in settings"):
        study.merge_results(old, other)


def test_cli_validation_and_help(capsys):
    assert study.main(["--sizes", "moe-0.2M,huge"]) == 2
    assert "unknown size 'huge'" in capsys.readouterr().err
    assert study.main(["--recipes", "bf16,fp9"]) == 2
    assert "unknown recipe 'fp9'" in capsys.readouterr().err
    assert study.main(["--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
    parser = study.build_parser()
    for action in parser._actions:
        assert action.help, f"flag {action.option_strings} has no help"
    assert [s.name for s in study.resolve_sizes("moe-1M,moe-0.2M")] == ["moe-1M", "moe-0.2M"]


def test_no_r3_replay_array_equals_the_trainers_own_routing_bitwise():
    """The study's "no R3" feeds an all -1 replay array (one compiled program for both variants); the trainer
    without R3 passes routed_experts=None. Both must give the same bits."""
    from jaxrl_fp8.model import random_policy
    from jaxrl_fp8.precision import get_recipe

    cfg = study.SIZE_PRESETS["tiny"][0].model_config(16)
    policy = random_policy(cfg, seed=1, recipe=get_recipe("bf16_train_fp8_rollout"))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 12)).astype(np.int32)
    own = policy.forward(ids, precision="rollout")
    none_replayed = policy.forward(ids, routed_experts=study._routed_none(2, 12, cfg), precision="rollout")
    np.testing.assert_array_equal(np.asarray(own.logits).view(np.uint32), np.asarray(none_replayed.logits).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(own.routed_experts), np.asarray(none_replayed.routed_experts))
