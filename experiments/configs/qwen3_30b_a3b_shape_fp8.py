"""Qwen3-30B-A3B shape, random weights, recipe fp8_block, collocated rollout, expert=8 (see _qwen3_30b_a3b_shape.py).

python -m jaxrl_fp8.train --config=experiments/configs/qwen3_30b_a3b_shape_fp8.py        # 8 GPUs
python -m jaxrl_fp8.train --config=experiments/configs/qwen3_30b_a3b_shape_fp8.py:tiny   # 8 virtual CPU devices
"""

import os
import runpy


def get_config(size: str = "full"):
    shared = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_qwen3_30b_a3b_shape.py"))
    return shared["shape_config"]("fp8_block", size or "full")
