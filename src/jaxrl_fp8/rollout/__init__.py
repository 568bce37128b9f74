"""Rollout: the engine protocol, an SGLang fleet client, the SGLang-API server, versioned weight sync.

Importing this package pulls in numpy and requests only (no JAX), so servers and clients start fast.
The embedded JAX engine lives in its own module and is imported explicitly by whoever runs it.
"""

from jaxrl_fp8.rollout.fleet import AllServersDead, FleetConfig, RolloutFailed, RolloutStats, SGLangFleet
from jaxrl_fp8.rollout.http_server import EmbeddedServer, ServerConfig, serve_forever, start_in_thread
from jaxrl_fp8.rollout.sglang_client import (
    MalformedResponse,
    RetryPolicy,
    RoutedExpertsUnsupported,
    SGLangClient,
    SGLangError,
    SGLangHTTPError,
    ServerUnavailable,
    decode_routed_experts,
    encode_routed_experts,
)
from jaxrl_fp8.rollout.types import (
    GenerateRequest,
    ModelInfo,
    RolloutEngine,
    Sample,
    SamplingParams,
    per_prompt_sampling,
    prompt_seed,
    sample_seed,
)
from jaxrl_fp8.rollout.weight_sync import (
    NcclWeightBroadcaster,
    SyncReport,
    WeightSyncConfig,
    WeightSyncError,
    WeightSynchronizer,
)

__all__ = [
    "AllServersDead",
    "EmbeddedServer",
    "FleetConfig",
    "GenerateRequest",
    "MalformedResponse",
    "ModelInfo",
    "NcclWeightBroadcaster",
    "RetryPolicy",
    "RolloutEngine",
    "RolloutFailed",
    "RolloutStats",
    "RoutedExpertsUnsupported",
    "SGLangClient",
    "SGLangError",
    "SGLangFleet",
    "SGLangHTTPError",
    "Sample",
    "SamplingParams",
    "ServerConfig",
    "ServerUnavailable",
    "SyncReport",
    "WeightSyncConfig",
    "WeightSyncError",
    "WeightSynchronizer",
    "decode_routed_experts",
    "encode_routed_experts",
    "per_prompt_sampling",
    "prompt_seed",
    "sample_seed",
    "serve_forever",
    "start_in_thread",
]
