"""meshpact.live.plans: checked plans executed on real process groups across two native domains.

| module | concept |
|---|---|
| ``domains`` | two native domains of real processes, each with its own group, and the bridge groups |
| ``executor`` | admits only checked, domain-local plans and runs them step by step |
| ``ops`` | each plan step in torch, the live twin of the core interpreter |
| ``meter`` | every collective call and bridge message counted at the call |
| ``jobs`` | what a run can be asked for: the request and the preset of sizes (torch-free) |
| ``workloads`` | the producer tensors: a vocabulary-sharded LM head, a Qwen3-14B MLP slice |
| ``verify`` | what each consumer observed against a single-process reference |
| ``bridge`` | a whole bridge run: plan, execute, meter, verify, record |

Names are imported lazily (torch is imported only when a name that needs it is used).
"""

from __future__ import annotations

from .._lazy import lazy_face

_EXPORTS = {
    "LiveRequest": "jobs",
    "PRESETS": "jobs",
    "get_preset": "jobs",
    "Executor": "executor",
    "PlanRefused": "executor",
    "admit": "executor",
    "Meter": "meter",
    "CallRecord": "meter",
    "measure": "meter",
    "Verdict": "verify",
    "verify_job": "verify",
    "Job": "bridge",
    "run_bridge": "bridge",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
