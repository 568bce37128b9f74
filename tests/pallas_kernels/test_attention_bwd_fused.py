"""The fused backward's schedule and its fixed order of dq adds (host side), simulated with random step times.

The kernel itself is checked in test_attention.py (interpret mode: gradients against autodiff of the reference, dk and
dv bitwise against the two-kernel backward; GPU: the same, and the same bits on every run)."""

import heapq

import numpy as np
import pytest

from pallas_kernels.attention_bwd_fused import schedule


def _steps(kt, q_blocks, group):
    return [(g, qb) for g in range(group) for qb in range(2 * kt, q_blocks)]


@pytest.mark.parametrize("batch,kv_heads,key_tiles,group,sms", [(1, 4, 8, 8, 132), (4, 4, 32, 8, 132),
                                                                 (2, 1, 5, 2, 3), (1, 2, 16, 4, 1)])
def test_schedule_lists_every_item_once_and_ranks_each_block(batch, kv_heads, key_tiles, group, sms):
    q_blocks = 2 * key_tiles
    items, counts, rank = schedule(batch, kv_heads, key_tiles, q_blocks, group, sms)
    listed = [int(i) for c in range(sms) for i in items[c, : counts[c]]]
    assert sorted(listed) == list(range(batch * kv_heads * key_tiles))
    assert (items[np.arange(items.shape[1])[None, :] >= counts[:, None]] == -1).all()
    loads = [sum(group * (q_blocks - 2 * (i % key_tiles)) for i in items[c, : counts[c]]) for c in range(sms)]
    total = sum(loads)
    longest = group * q_blocks
    assert max(loads) <= total / sms + longest  # list scheduling's bound
    for bh in range(batch * kv_heads):
        for qb in range(q_blocks):
            adders = [bh * key_tiles + kt for kt in range(min(qb // 2, key_tiles - 1) + 1)]
            assert sorted(rank[adders, qb]) == list(range(len(adders)))  # a permutation: one adder per place


@pytest.mark.parametrize("key_tiles,sms,seed", [(12, 5, 0), (12, 5, 1), (24, 7, 2), (9, 40, 3)])
def test_fixed_order_never_deadlocks(key_tiles, sms, seed):
    """The kernel's protocol, simulated: each warpgroup of a CTA walks its items' steps; a step's add waits until
    its block's counter reaches the step's rank, and the previous add is signalled before that wait (after the
    step's compute). The two warpgroups of a CTA share a ring of `stages` slots (one can run at most that many steps
    ahead). Random step times; every add must happen, in rank order."""
    batch, kv_heads, group, stages = 2, 2, 2, 2
    q_blocks = 2 * key_tiles
    items, counts, rank = schedule(batch, kv_heads, key_tiles, q_blocks, group, sms)
    rng = np.random.default_rng(seed)
    walk = {c: [(int(i), g, qb) for i in items[c, : counts[c]] for g, qb in _steps(int(i) % key_tiles, q_blocks, group)]
            for c in range(sms)}
    counter = {}
    order = {}
    pos = {(c, w): 0 for c in walk for w in range(2)}
    prev = {(c, w): None for c in walk for w in range(2)}
    events = [(rng.random(), c, w) for c in walk for w in range(2) if walk[c]]
    heapq.heapify(events)
    waiting = []
    while events:
        now, c, w = heapq.heappop(events)
        s = pos[(c, w)]
        if s >= len(walk[c]):  # past the last step: the final signal
            if prev[(c, w)] is not None:
                counter[prev[(c, w)]] = counter.get(prev[(c, w)], 0) + 1
                prev[(c, w)] = None
        else:
            item, g, qb = walk[c][s]
            block = (w, item // key_tiles, g, qb)
            if prev[(c, w)] is not None and prev[(c, w)] != ("signalled", s):
                counter[prev[(c, w)]] = counter.get(prev[(c, w)], 0) + 1
                prev[(c, w)] = ("signalled", s)
            other = pos[(c, 1 - w)]
            if counter.get(block, 0) < rank[item, qb] or s - other >= stages:
                waiting.append((c, w))  # blocked on the counter or on the ring
                if not events:
                    break
                continue
            order.setdefault(block, []).append(rank[item, qb])
            prev[(c, w)] = block
            pos[(c, w)] = s + 1
            heapq.heappush(events, (now + rng.exponential(1.0), c, w))
        if waiting:  # anything that may have been unblocked retries
            for cw in waiting:
                heapq.heappush(events, (now + 1e-9, *cw))
            waiting = []
    assert all(pos[(c, w)] == len(walk[c]) for c in walk for w in range(2)), "deadlock"
    for block, ranks in order.items():
        assert ranks == sorted(ranks) == list(range(len(ranks))), block
