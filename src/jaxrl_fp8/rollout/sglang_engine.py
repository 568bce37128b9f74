"""An SGLang fleet as the trainer's rollout engine, with weight pushes through the converter's export.

Why a wrapper: the fleet speaks SGLang's HTTP API; the trainer hands over a model. Pushing means writing the
new weights in the recipe's rollout format into the shared `weight_sync_dir` with `converters.export` (the very
quantizers the trainer computes with) and asking every server to load that directory
(`SGLangFleet.update_weights_from_disk`: pause, load, verify version, continue). Old versions are deleted
after a successful push, keeping the current and the previous one (the fleet's rollback target).
"""

from __future__ import annotations

import os
import shutil

from jaxrl_fp8 import distributed
from jaxrl_fp8.model.config import to_hf_config
from jaxrl_fp8.precision import PrecisionPolicy, Recipe
from jaxrl_fp8.rollout.fleet import FleetConfig, SGLangFleet

__all__ = ["SGLangFleetEngine"]


class SGLangFleetEngine(SGLangFleet):
    def __init__(self, urls, *, weight_sync_dir: str, recipe: Recipe, policy: PrecisionPolicy, model_config,
                 hf_config: dict | None = None, side_files_from: str | None = None, keep_versions: int = 2,
                 fleet_config: FleetConfig = FleetConfig()):
        shape = (model_config.num_hidden_layers, max(model_config.num_experts_per_tok, 1))
        super().__init__(urls, config=fleet_config, routed_experts_shape=shape)
        self.weight_sync_dir = os.path.abspath(weight_sync_dir)
        self.recipe = recipe
        self.policy = policy
        self.hf_config = hf_config or to_hf_config(model_config, dtype="bfloat16")
        self.side_files_from = side_files_from
        self.keep_versions = keep_versions
        self._written: list[str] = []

    def push_model(self, model, weight_version: str) -> str:
        """Export `model` in the rollout format to weight_sync_dir/<version> and load it on every server.

        Multi-host: every process takes part in the export (its gathers are collectives) but only process 0
        writes the directory and talks to the servers; the others wait for it and then expect the same version.
        """
        from converters.export import save_exported

        version = str(weight_version)
        writer = distributed.is_writer()
        path = os.path.join(self.weight_sync_dir, version)
        if writer:
            os.makedirs(self.weight_sync_dir, exist_ok=True)
        save_exported(model, self.recipe, self.policy, path, hf_config=self.hf_config, overwrite=True,
                      side_files_from=self.side_files_from, write=writer)
        if writer:
            self.update_weights_from_disk(path, version)
            self._written.append(path)
            while len(self._written) > self.keep_versions:
                shutil.rmtree(self._written.pop(0), ignore_errors=True)
        distributed.barrier(f"sglang-push-{version}")
        if not writer:
            self.current_checkpoint, self.expected_weight_version = path, version
        return path
