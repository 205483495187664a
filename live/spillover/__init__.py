"""meshpact.live.spillover: serving across the vendor boundary over a shaped link.

| module | concept |
|---|---|
| ``decoder`` | small decoders with the real vocabularies of three model families |
| ``serving`` | the entry point of every run, and the requests deployment: host 1's local slots, host 2's overflow, results as checked plans |
| ``loop`` | what the three loops share: requests' tokens, closed-loop clients, checked plans, the link's probes |
| ``split`` | the model deployment: the decoder split by layers, outputs checked against a replay |
| ``speculative`` | a draft on host 1, the target on host 2: full logits or verification at the source |
| ``compiled`` | an exportable decode step, compiled ahead of time with AOTInductor |
| ``pairs`` | paired runs (full logits against source projection) with the simulator beside them |

The two hosts themselves (namespaces, shaped veth) are :mod:`meshpact.live.netns`, shared
with the partition fault. Names are imported lazily.
"""

from __future__ import annotations

from .._lazy import lazy_face

_EXPORTS = {
    "FAMILIES": "decoder",
    "DecoderSpec": "decoder",
    "Decoder": "decoder",
    "SpilloverConfig": "serving",
    "RunResult": "serving",
    "run_once": "serving",
    "OutputCheck": "split",
    "SPECULATIVE_REQUESTS": "speculative",
    "StepModule": "compiled",
    "Row": "pairs",
    "measure_pairs": "pairs",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
