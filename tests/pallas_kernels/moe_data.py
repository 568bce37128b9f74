"""Routing of the GPU grouped-kernel tests: ragged experts, one of them empty, rows past the groups."""

import numpy as np

EXPERTS, ROWS, TAIL = 16, 4000, 100


def ragged_sizes(seed: int) -> np.ndarray:
    """int [EXPERTS]: multinomial sizes over ROWS - TAIL rows, expert 3 empty (its rows go to expert 5)."""
    sizes = np.random.default_rng(seed).multinomial(ROWS - TAIL, np.ones(EXPERTS) / EXPERTS)
    sizes[5] += sizes[3]
    sizes[3] = 0
    return sizes

