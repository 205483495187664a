"""Ranks lost and ranks gone: what the agent and the job tell each other over the control channel.

Two messages, one each way. The job declares a rank *lost* (silent for the rank-loss bound,
:func:`~meshpact.live.recovery.consensus.declared_lost`): the agent that runs it kills its process,
and its next look replaces it. The agent announces a rank *gone* (its process exited and no
replacement will come, :func:`~meshpact.live.recovery.consensus.mark_gone`): the survivors excise it
or end saying why, instead of waiting for a replacement.
"""

from __future__ import annotations

from ..recovery.consensus import declared_lost, mark_gone
from ..recovery.control import ControlChannel
from .processes import say

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
