"""jaxrl_fp8: RL for Mixture-of-Experts LLMs in JAX with one low-precision contract for rollout and training."""

__version__ = "0.1.0"
