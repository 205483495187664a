"""meshpact.live.recovery: in-memory recovery of sharded training from communication faults.

| module | concept |
|---|---|
| ``runtime`` | the session, ``resilient(model, optimizer)`` and the resilient step |
| ``consensus`` | agreement on generation and committed step: pure ``decide``, transport ``agree`` |
| ``control`` | the out-of-band control channel (a TCPStore the data path never touches) |
| ``communicator`` | data-path groups, one per generation, and how to replace one |
| ``rebind`` | every cached process-group reference pointed at the replacement |
| ``opcount`` | operations counted per group: proof that a rebind took effect |
| ``faults`` | fault injection (raised collective, stall, partition, kill) |
| ``checkpoint`` | checkpoints: the baselines in-memory recovery is measured against |
| ``harness`` | the built-in FSDP2 training workload |
| ``trial`` | a recovery trial: reference run, faulted run, baselines |
| ``probe`` | probes of the communicator path alone, for the benchmark |

Names are imported lazily, so ``from meshpact.live.recovery import FaultKind`` needs no torch.
"""

from __future__ import annotations

from .._lazy import lazy_face

_EXPORTS = {
    "RecoveryConfig": "runtime", "Session": "runtime", "start_session": "runtime",
    "Resilient": "runtime", "resilient": "runtime",
    "Proposal": "consensus", "Decision": "consensus", "decide": "consensus", "agree": "consensus",
    "ConsensusError": "consensus",
    "ControlChannel": "control", "ControlTimeout": "control",
    "find_references": "rebind", "RebindReport": "rebind",
    "OpCounter": "opcount",
    "FaultKind": "faults", "Fault": "faults", "FaultInjector": "faults", "CollectiveFault": "faults",
    "plan_faults": "faults",
    "Checkpointer": "checkpoint", "AsyncCheckpointer": "checkpoint",
    "TrialConfig": "trial", "TrialResult": "trial", "run_trial": "trial",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
