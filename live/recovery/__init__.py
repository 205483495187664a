"""meshpact.live.recovery: in-memory recovery of sharded training from communication faults.

| module | concept |
|---|---|
| ``config`` | `RecoveryConfig`: every timeout derived from a few inputs, orderings checked |
| ``session`` | one rank's place in the job: stores, control channel, groups, mesh |
| ``generation`` | `Generation`: one set of data-path groups, mesh and members, as a value |
| ``runtime`` | ``resilient(model, optimizer, session)`` and the resilient step |
| ``pipeline`` | a recovery's six stages: detect, agree, rebuild, rebind, restore, resume |
| ``stepreset`` | undo a half-run FSDP2 step |
| ``state`` | a rank's state: shards, optimizer state, generators; the O(1) commit check |
| ``workload`` | the user's training loop as a file: ``build``, ``batch``, ``train_step``, ``MESH`` |
| ``consensus`` | agreement on generation and committed step: pure ``decide``, transport ``agree`` |
| ``refusal`` | a recovery that cannot happen: one line on every rank, and no replacement for it |
| ``control`` | the out-of-band control channel (a TCPStore the data path never touches) |
| ``communicator`` | data-path groups, one per generation, and how to replace one |
| ``rebind`` | every cached process-group reference pointed at the replacement |
| ``opcount`` | operations counted per group: proof that a rebind took effect |
| ``faults`` | fault injection (raised collective, stall, partition, kill) |
| ``checkpoint`` | checkpoints: the baselines in-memory recovery is measured against |

The trial bench that drives this library from outside is :mod:`meshpact.live.trials`.

Names are imported lazily, so ``from meshpact.live.recovery import FaultKind`` needs no torch.
"""

from __future__ import annotations

from .._lazy import lazy_face

_EXPORTS = {
    "RecoveryConfig": "config",
    "TimeoutOrderError": "config",
    "Session": "session",
    "start_session": "session",
    "Generation": "generation",
    "Resilient": "runtime",
    "resilient": "runtime",
    "is_comm_fault": "runtime",
    "RecoveryRecord": "runtime",
    "GuardedBlockLost": "runtime",
    "RngState": "state",
    "capture_rng": "state",
    "restore_rng": "state",
    "commit_check": "state",
    "Workload": "workload",
    "WorkloadError": "workload",
    "MeshSpec": "workload",
    "check_workload": "workload",
    "load_workload": "workload",
    "shipped_workloads": "workload",
    "Proposal": "consensus",
    "Decision": "consensus",
    "decide": "consensus",
    "agree": "consensus",
    "ConsensusError": "consensus",
    "RecoveryImpossible": "refusal",
    "ControlChannel": "control",
    "ControlTimeout": "control",
    "find_references": "rebind",
    "RebindReport": "rebind",
    "UnreachableGroupWarning": "rebind",
    "OpCounter": "opcount",
    "FaultKind": "faults",
    "Fault": "faults",
    "FaultInjector": "faults",
    "CollectiveFault": "faults",
    "plan_faults": "faults",
    "Checkpointer": "checkpoint",
    "AsyncCheckpointer": "checkpoint",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
