"""Collocated rollout (8 virtual CPU devices, one subprocess: collocated.py), mesh expert=4 x fsdp=2.

The embedded engine on the training mesh takes the trainer's sharded weights by reference (the push runs under a
transfer guard that forbids any host<->device copy), keeps them sharded (experts on their devices, FSDP shards
of whole quantization blocks), and samples with the trainer's sharded forward (expert-parallel MoE, rows over
the batch axes). The trainer's recomputed log-probs (R3 replay) equal the rollout's bit for bit for fp8_block
and bf16. The engine on one device ("separate") is measured too: it is bitwise as well, because the forward is
row invariant (docs/architecture.md, "Row invariance").
"""

import json

import pytest

from subprocess_util import run_script

pytestmark = pytest.mark.slow
RECIPES = ("fp8_block", "bf16")
# bf16's bitwise comparisons across row counts hold only where XLA:CPU's BF16 dots are row invariant (conftest)
BITWISE_RECIPES = ("fp8_block", pytest.param("bf16", marks=pytest.mark.row_invariant_cpu))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("collocated")
    run_script("collocated.py", str(out), timeout=1200)
    with open(out / "results.json") as f:
        return json.load(f)


@pytest.mark.parametrize("recipe", BITWISE_RECIPES)
def test_collocated_rollout_logprobs_equal_the_sharded_trainer_bitwise(results, recipe):
    r = results["recipes"][recipe]["collocated"]
    assert r["rows"] == 16 and r["tokens"] == 16 * 6  # 8 prompts x 2 samples x 6 new tokens, all compared
    assert r["bitwise"] and r["max_abs_diff"] == 0.0, r


@pytest.mark.parametrize("recipe", RECIPES)
def test_separate_engine_on_one_device_is_bitwise_too(results, recipe):
    r = results["recipes"][recipe]
    assert r["separate_devices"] == 1
    assert r["separate"]["bitwise"] and r["separate"]["max_abs_diff"] == 0.0, r["separate"]
    # same seeds, same bits: both placements sample the same tokens
    assert r["separate"]["response_ids"] == r["collocated"]["response_ids"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_collocated_weights_stay_sharded_and_are_not_aliased(results, recipe):
    r = results["recipes"][recipe]
    assert r["engine_devices"] == 8
    assert r["shares_trainer_buffers"] is False  # the trainer donates its buffers to the next update
    assert r["expert_up_proj_shard"][0] == 2  # 8 experts over expert=4
    per_device = r["engine_weight_bytes_per_device"]
    assert len(per_device) == 1
    if recipe == "bf16":
        # every BF16 operand split 8 ways ((fsdp, expert) on embed, expert on the stacks): 1/8 of the model
        assert r["expert_up_proj_spec"] == ["expert", "None", "fsdp"]
        assert per_device[0] * 8 <= r["engine_weight_bytes_total"] * 1.01
    else:
        # fp8-block operands keep whole 128x128 blocks: hidden=128 is one block, so the dense projections are
        # not split; the expert stacks still are (4 ways) -> under half the model per device
        assert r["expert_up_proj_type"] == "QuantizedWeight" and r["expert_up_proj_spec"] == ["expert", "None", "None"]
        assert per_device[0] < 0.5 * r["engine_weight_bytes_total"]
        assert any("would cut a 128-wide FP8 block" in n for n in r["notes"])
