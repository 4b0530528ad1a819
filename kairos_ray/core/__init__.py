"""The Kairos scheduling core: pure functions and frozen snapshots, shared by the simulator and the live router.

Imports only the standard library and numpy: no ray, vllm, torch, scikit-learn,
asyncio or clock. Time and state arrive as arguments.
"""

from kairos_ray.core.admission import (
    AdmissionMode,
    AdmissionParams,
    JoinGuard,
    handoff_fits,
    handoff_ttft_s,
    join_guard,
    joined_step_fits,
    judge,
    kv_wait_s,
)
from kairos_ray.core.estimate import (
    PREFILL_ESTIMATORS,
    decode_ttft_s,
    prefill_ttft_exact_s,
    prefill_ttft_paper_s,
    queue_wait_paper_s,
)
from kairos_ray.core.latency import FEATURE_NAMES, StepLatency, StepLatencyModel, StepwiseLatency, features, tiles
from kairos_ray.core.policy import POLICIES, Guard, Policy, PolicyParams, Thresholds, make_policy, parse_spec
from kairos_ray.core.prefix import (
    BlockCache,
    BlockHash,
    CacheDelta,
    JournaledBlockCache,
    PrefixHits,
    block_hashes,
    block_ids,
)
from kairos_ray.core.state import (
    Admission,
    ClusterView,
    Decision,
    DecodeNodeView,
    PrefillNodeView,
    Route,
    ShedReason,
    apply_decision,
    node_after,
    with_nodes,
)
from kairos_ray.core.sweep import tbt_safe_schedule

__all__ = [
    "FEATURE_NAMES",
    "POLICIES",
    "PREFILL_ESTIMATORS",
    "Admission",
    "AdmissionMode",
    "AdmissionParams",
    "BlockCache",
    "BlockHash",
    "CacheDelta",
    "ClusterView",
    "Decision",
    "DecodeNodeView",
    "Guard",
    "JoinGuard",
    "JournaledBlockCache",
    "Policy",
    "PolicyParams",
    "PrefillNodeView",
    "PrefixHits",
    "Route",
    "ShedReason",
    "StepLatency",
    "StepLatencyModel",
    "StepwiseLatency",
    "Thresholds",
    "apply_decision",
    "block_hashes",
    "block_ids",
    "decode_ttft_s",
    "features",
    "handoff_fits",
    "handoff_ttft_s",
    "join_guard",
    "joined_step_fits",
    "judge",
    "kv_wait_s",
    "make_policy",
    "node_after",
    "parse_spec",
    "prefill_ttft_exact_s",
    "prefill_ttft_paper_s",
    "queue_wait_paper_s",
    "tbt_safe_schedule",
    "tiles",
    "with_nodes",
]
