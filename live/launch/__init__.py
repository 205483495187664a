"""meshpact.live.launch: starting a job's ranks, and what happens to a rank's process when it fails.

``meshpact launch`` is torchrun's command line on torch.distributed.elastic with one decision
changed: a failed worker is replaced alone, in place, while every other worker keeps running and
keeps its memory. What each file decides:

| module | decides |
|---|---|
| ``command`` | ``meshpact launch``'s command line: torchrun's flags, Meshpact's, the job key, one node's agent run |
| ``elastic`` | `ReplacingAgent`: one node's agent; it starts workers and asks its collaborators below |
| ``replacement`` | which failed worker gets a new process (same rank, next incarnation), and the group's end |
| ``sparepool`` | which warm interpreter a failed worker's rank is promoted into |
| ``gone`` | the ranks the job declared lost (killed here) and the ranks announced gone to the job |
| ``nodes`` | node loss: a silent agent's node, group rank 0's verdict, a spare node given its ranks |
| ``spareagent`` | `SpareAgent`: a spare node standing by, then acting as the node it was given |
| ``rendezvous`` | how an agent finds its job: elastic's handlers on named addresses, a spare's standby |
| ``controlplane`` | `ControlPlane`: the job's stores and node-loss verdicts on a host that trains nothing |
| ``workerenv`` | the environment a worker starts with: torchrun's and what the recovery runtime reads |
| ``processes`` | a rank's process as the agent holds it, how it is signalled, the agent's one-line messages |
| ``warmspare`` | the warm spare itself: an interpreter with torch imported, waiting for a rank |
| ``warmstart`` | `WarmStart` (``--warm-start``): a node's workers and spares forked from one process, or why not |
| ``agentjob`` | `AgentJob`: one node's job under the same agent, run inside the calling program |
| ``launcher`` | `launch()`: a worker function on N local ranks, each rank's value collected |
| ``forkserver`` | `ForkServer`: rank processes forked from a process that imported torch once |
| ``worker`` | what runs inside a rank process: its entry point, arguments and result |

``python -m meshpact.launch`` and ``meshpact launch`` run :func:`~meshpact.live.launch.command.main`.

Names are imported lazily, so ``from meshpact.live.launch import LaunchedProcess`` needs no torch.
"""

from __future__ import annotations

from .._lazy import lazy_face

_EXPORTS = {
    "main": "command",
    "launch_key": "command",
    "ReplacingAgent": "elastic",
    "LaunchOptions": "elastic",
    "LaunchRefused": "elastic",
    "Replacements": "replacement",
    "SparePool": "sparepool",
    "GoneRanks": "gone",
    "NodeWatch": "nodes",
    "NodeLoss": "nodes",
    "NodeEnv": "nodes",
    "SpareNode": "nodes",
    "NodeVerdict": "nodes",
    "choose_spare": "nodes",
    "HostNodeLost": "nodes",
    "SpareAgent": "spareagent",
    "NoJobFound": "spareagent",
    "StandbyRendezvous": "rendezvous",
    "StandbyRecord": "rendezvous",
    "rendezvous_handler": "rendezvous",
    "ControlPlane": "controlplane",
    "ControlPlaneOptions": "controlplane",
    "ControlPlaneHost": "controlplane",
    "ControlPlaneRefused": "controlplane",
    "AgentJob": "agentjob",
    "AgentJobResult": "agentjob",
    "launch": "launcher",
    "LaunchError": "worker",
    "LaunchedProcess": "worker",
    "RankResult": "worker",
    "ForkServer": "forkserver",
    "WarmStart": "warmstart",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
