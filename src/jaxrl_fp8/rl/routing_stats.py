"""How widely a rollout's decode steps spread over the experts. Pure NumPy on the R3 routing the batch carries.

Why: a decode step reads the weights of every expert its rows route to, so the number of distinct experts per step
(not the token count) sets an MoE rollout's weight traffic, and with it what FP8 weights save. A load-balanced
(trained) router spreads 64 rows x top-8 over nearly all of 128 experts; a random-init model can route every token
of a row alike (its residual stream is mostly attention's average of the context) and touch a quarter of them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["decode_experts_touched"]


def decode_experts_touched(routed: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray,
                           num_experts: int, max_steps: int = 256, max_picks: int = 4_000_000) -> float:
    """Mean over decode steps and MoE layers of the distinct experts the batch's rows routed to in that step.

    routed int [B, L, layers, k] (routing of the token at each position, -1 where none: padding, dense layers);
    decode step j of row b fed response token j at position prompt_lengths[b] + j (j < response_lengths[b] - 1:
    the last response token is never fed). Steps are aligned by j across rows (continuous batching interleaves them,
    but every step runs each active row's j-th feed). At most `max_steps` evenly spaced steps are counted (a mean: a
    16k-token, 48-layer batch would otherwise index ~400M picks on the host every RL step), and fewer when the batch
    has many rows: at most `max_picks` (rows x steps x layers x top-k) are indexed, so 512 rows of a 48-layer top-8
    model count ~20 steps instead of 256 (int32 cells: ~50 MB of host work per RL step). NaN when no row decoded.
    """
    routed = np.asarray(routed)
    b, length, layers, k = routed.shape
    lens = np.asarray(response_lengths) - 1
    steps = int(max(lens.max(), 0)) if b else 0
    if steps == 0:
        return float("nan")
    counted = max(1, min(steps, max_steps, max_picks // max(b * layers * k, 1)))
    j = np.unique(np.linspace(0, steps - 1, counted).astype(np.int64))  # [S] the steps counted
    pos = np.asarray(prompt_lengths)[:, None] + j[None, :]  # [B, S]
    live = (j[None, :] < lens[:, None]) & (pos < length)
    rows, cols = np.nonzero(live)
    picks = routed[rows, pos[rows, cols]]  # [n, layers, k]
    # one flat (step, layer, expert) cell per pick; a cell counts once however many rows picked it
    cell = ((cols.astype(np.int32)[:, None, None] * layers + np.arange(layers, dtype=np.int32)[None, :, None])
            * num_experts + picks)
    touched = np.zeros(len(j) * layers * num_experts, bool)
    touched[cell[picks >= 0]] = True
    counts = touched.reshape(len(j), layers, num_experts).sum(axis=-1)  # [S, layers]
    moe_layers = np.any(picks >= 0, axis=(0, 2))  # dense layers route nothing (-1)
    sel = counts[np.any(live, axis=0)][:, moe_layers]
    return float(sel.mean()) if sel.size else float("nan")
