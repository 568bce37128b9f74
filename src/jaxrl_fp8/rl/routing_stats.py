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
                           num_experts: int) -> float:
    """Mean over decode steps and MoE layers of the distinct experts the batch's rows routed to in that step.

    routed int [B, L, layers, k] (routing of the token at each position, -1 where none: padding, dense layers);
    decode step j of row b fed response token j at position prompt_lengths[b] + j (j < response_lengths[b] - 1:
    the last response token is never fed). Steps are aligned by j across rows (continuous batching interleaves them,
    but every step runs each active row's j-th feed). NaN when no row decoded.
    """
    routed = np.asarray(routed)
    b, length, layers, _ = routed.shape
    steps = int(max(np.max(np.asarray(response_lengths)) - 1, 0)) if b else 0
    if steps == 0:
        return float("nan")
    j = np.arange(steps)
    pos = np.asarray(prompt_lengths)[:, None] + j[None, :]  # [B, steps]
    live = (j[None, :] < np.asarray(response_lengths)[:, None] - 1) & (pos < length)
    rows = np.broadcast_to(np.arange(b)[:, None], pos.shape)
    picks = routed[rows[live], pos[live]]  # [n, layers, k]
    step_of = np.broadcast_to(j[None, :], pos.shape)[live]
    touched = np.zeros((steps, layers, num_experts), bool)
    layer_idx = np.broadcast_to(np.arange(layers)[None, :, None], picks.shape)
    step_idx = np.broadcast_to(step_of[:, None, None], picks.shape)
    ok = picks >= 0
    touched[step_idx[ok], layer_idx[ok], picks[ok]] = True
    counts = touched.sum(axis=-1)  # [steps, layers]
    moe_layers = np.any(routed >= 0, axis=(0, 1, 3))
    active_steps = np.bincount(step_of, minlength=steps) > 0
    sel = counts[active_steps][:, moe_layers]
    return float(sel.mean()) if sel.size else float("nan")
