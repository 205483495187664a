"""meshpact.live.trials: the trial bench, a client of :mod:`meshpact.live.recovery`.

A trial runs a workload twice (a fault-free reference and a faulted run) and any baselines,
through the launcher, and compares the final states bit for bit. None of this is needed to
use ``resilient()`` in a training job of one's own.

| module | concept |
|---|---|
| ``trialconfig`` | a trial's settings (torch-free) |
| ``trial`` | a recovery trial from the parent: reference run, faulted run, baselines |
| ``rankworker`` | the rank side of a trial |
| ``drills`` | the excising reference: planned excisions with no fault |
| ``analysis`` | a trial's numbers and the bit-identity check |
| ``outcome`` | what one rank process reports back (typed) |
| ``harness`` | the built-in FSDP2 decoder (the ``decoder`` workload's model) |
| ``probe`` | probes of the communicator path alone, for the benchmark |

Names are imported lazily, so ``from meshpact.live.trials import TrialConfig`` needs no torch.
"""

from __future__ import annotations

from .._lazy import lazy_face

_EXPORTS = {"TrialConfig": "trialconfig", "TrialResult": "analysis", "run_trial": "trial", "RankOutcome": "outcome"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
