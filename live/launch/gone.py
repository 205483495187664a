"""Ranks lost and ranks gone: what the agent and the job tell each other over the control channel.

Two messages, one each way. The job declares a rank *lost* (silent for the rank-loss bound,
:func:`~meshpact.live.recovery.consensus.declared_lost`): the agent that runs it kills its process,
and its next look replaces it. The agent announces a rank *gone* (its process exited and no
replacement will come, :func:`~meshpact.live.recovery.consensus.mark_gone`): the survivors excise it
or end saying why, instead of waiting for a replacement.
"""

from __future__ import annotations

import time
from typing import Mapping

from torch.distributed.elastic.agent.server.api import WorkerGroup

from ..recovery.consensus import declared_lost, mark_gone
from ..recovery.control import ControlChannel
from .nodes import NodeWatch
from .processes import Running, kill, say

__all__ = ["GoneRanks"]


class GoneRanks:
    """One agent's side of both messages; it reads the declared lost every ``loss_watch_s`` at most."""

    def __init__(self, loss_watch_s: float) -> None:
        self.loss_watch_s = loss_watch_s
        self.seen_round = 0  # declarations of rounds up to this one were read
        self._next_look = 0.0

    def due(self, now: float) -> bool:
        """Whether it is time for the next look (and, if so, the one after is ``loss_watch_s`` away)."""
        if now < self._next_look:
            return False
        self._next_look = now + self.loss_watch_s
        return True

    def declared(self, channel: ControlChannel) -> list[tuple[int, int]]:
        """(round, rank) the job declared lost since the last read, in round order (raises what the
        channel raises when its host does not answer)."""
        out = []
        for round_, ranks in sorted(declared_lost(channel, self.seen_round).items()):
            self.seen_round = max(self.seen_round, round_)
            out += [(round_, rank) for rank in ranks]
        return out

    def kill_declared(
        self,
        channel: ControlChannel | None,
        wg: WorkerGroup,
        nodes: NodeWatch,
        watched: Mapping[int, Running],
        control: tuple[str, int],
        hosted_by_caller: bool,
    ) -> None:
        """A rank the job declared lost (silent for the rank-loss bound) whose process is one of this
        agent's ``watched`` (local rank -> process) is killed; the agent's next look replaces it. Each
        look also beats, and group rank 0 watches the other nodes (:meth:`.nodes.NodeWatch.look`)."""
        now = time.monotonic()
        if not self.due(now):
            return
        assert channel is not None
        try:
            nodes.look(channel, wg, now)
            lost = self.declared(channel)
        except (RuntimeError, OSError) as exc:  # the channel's host (node 0) gone: nothing to learn from it now
            nodes.unanswered(now, exc, control, nodes.judges_host(wg.group_rank, hosted_by_caller))
            return
        nodes.answered()
        mine = {w.global_rank: w.local_rank for w in wg.workers}
        for round_, rank in lost:
            running = watched.get(mine.get(rank, -1))
            if running is not None and running.handler.proc.poll() is None:
                say(f"rank {rank} (pid {running.pid}) was declared lost by the job in round {round_}: killed")
                kill(running.handler.proc)

    @staticmethod
    def announce(channel: ControlChannel, rank: int) -> None:
        """Tell the job ``rank`` is gone; a channel that does not answer is said in one line (the next
        look says what that means)."""
        try:
            mark_gone(channel, rank)
        except (RuntimeError, OSError) as exc:
            say(
                f"cannot tell the job that rank {rank} is gone: the control channel did not answer "
                f"({str(exc).splitlines()[0]})"
            )
