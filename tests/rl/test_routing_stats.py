import numpy as np

from jaxrl_fp8.rl.routing_stats import decode_experts_touched


def test_counts_distinct_experts_per_decode_step_and_layer():
    # 2 rows, prompts of 2 and 1 tokens, responses of 3 and 2 tokens; 2 layers (the second dense: -1), top-2 of 8
    routed = np.full((2, 6, 2, 2), -1, np.int32)
    routed[0, 2] = [[0, 1], [-1, -1]]  # row 0, step 0
    routed[0, 3] = [[0, 2], [-1, -1]]  # row 0, step 1
    routed[0, 4] = [[7, 6], [-1, -1]]  # row 0's last response token: never fed, not counted
    routed[1, 1] = [[1, 3], [-1, -1]]  # row 1, step 0
    routed[1, 2] = [[5, 5], [-1, -1]]  # row 1's last token: not counted
    got = decode_experts_touched(routed, np.array([2, 1]), np.array([3, 2]), num_experts=8)
    # step 0: {0, 1, 3} = 3 experts; step 1: {0, 2} = 2 (row 1 done); the dense layer is left out
    assert got == 2.5


def test_no_decode_step_is_nan():
    routed = np.zeros((1, 3, 1, 1), np.int32)
    assert np.isnan(decode_experts_touched(routed, np.array([2]), np.array([1]), num_experts=4))


def test_long_batches_count_a_bounded_sample_of_steps():
    """A long response is counted on evenly spaced steps (host work bounded per RL step); the mean is unchanged when
    every step routes alike."""
    rng = np.random.default_rng(0)
    b, p, t, layers, k, e = 4, 3, 5000, 2, 2, 16
    step_routing = rng.integers(0, e, size=(b, 1, layers, k)).astype(np.int32)
    routed = np.full((b, p + t, layers, k), -1, np.int32)
    routed[:, p:] = step_routing  # every decode step: the same picks
    want = np.mean([len(np.unique(step_routing[:, 0, layer])) for layer in range(layers)])
    got = decode_experts_touched(routed, np.full(b, p), np.full(b, t), num_experts=e, max_steps=64)
    assert got == want


def test_many_rows_count_fewer_steps_with_the_same_mean():
    """Host work is bounded by picks, not steps alone: a batch of many rows counts fewer steps (same mean when every
    step routes alike)."""
    rng = np.random.default_rng(1)
    b, p, t, layers, k, e = 64, 2, 300, 3, 4, 32
    step_routing = rng.integers(0, e, size=(b, 1, layers, k)).astype(np.int32)
    routed = np.full((b, p + t, layers, k), -1, np.int32)
    routed[:, p:] = step_routing
    want = np.mean([len(np.unique(step_routing[:, 0, layer])) for layer in range(layers)])
    capped = decode_experts_touched(routed, np.full(b, p), np.full(b, t), num_experts=e, max_picks=b * layers * k * 7)
    assert capped == want == decode_experts_touched(routed, np.full(b, p), np.full(b, t), num_experts=e)
