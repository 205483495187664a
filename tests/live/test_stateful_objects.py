"""Objects registered as state (DCP's Stateful protocol: a StatefulDataLoader, an EMA) travel
with the job state: through a DCP checkpoint and a peer copy, back bit for bit."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from meshpact.live.recovery.checkpoint import Checkpointer
from meshpact.live.recovery.peers import deserialize, serialize
from meshpact.live.recovery.state import check_stateful, job_state, load_job_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Ema:
    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: torch.nn.Module) -> None:
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(0.9).add_(v.detach(), alpha=0.1)

    def state_dict(self) -> dict:
        return {k: v.clone() for k, v in self.shadow.items()}

    def load_state_dict(self, state: dict) -> None:
        self.shadow = {k: v.clone() for k, v in state.items()}


def _loader(seed: int = 3) -> StatefulDataLoader:
    data = torch.arange(64.0).reshape(32, 2)
    return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _job():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("path", ["checkpoint", "peer copy"])
def test_a_data_position_and_an_ema_come_back_bit_for_bit(tmp_path, path):
    model, opt = _job()
    loader, ema = _loader(), Ema(model)
    it = iter(loader)
    for _ in range(3):  # three steps trained: three batches drawn, the EMA moved three times
        model(next(it)).sum().backward()
        opt.step()
        ema.update(model)
    state = job_state(model, opt, objects={"data": loader, "ema": ema})
    if path == "checkpoint":
        Checkpointer(tmp_path, 0, 1, 1).save(3, state)
        state = Checkpointer(tmp_path, 0, 1, 1).load(3)
    else:
        state = deserialize(serialize(3, state))[1]
    expected = [next(it) for _ in range(4)]  # the rest of the epoch as the job would have drawn it
    model2, opt2 = _job()
    loader2, ema2 = _loader(seed=99), Ema(model2)  # another shuffle and a fresh EMA: both must be overwritten
    load_job_state(model2, opt2, state, objects={"data": loader2, "ema": ema2})
    it2 = iter(loader2)
    assert all(torch.equal(a, next(it2)) for a in expected)
    assert all(torch.equal(ema.shadow[k], ema2.shadow[k]) for k in ema.shadow)


def test_registering_other_objects_than_were_committed_is_refused_and_a_non_stateful_one_by_name():
    model, opt = _job()
    state = job_state(model, opt, objects={"data": _loader()})
    with pytest.raises(ValueError, match=r"holds objects \['data'\]; this job registered \['ema'\]"):
        load_job_state(model, opt, state, objects={"ema": Ema(model)})
    with pytest.raises(TypeError, match="'loss' \\(float\\) has not"):
        check_stateful({"data": _loader(), "loss": 0.5})


class _Stream:
    """A rank's loader and the iterator reading it (as the shipped ``streamed`` workload keeps one)."""

    def __init__(self, rank: int) -> None:
        self.loader = _loader(seed=100 + rank)
        self._it: Iterator[torch.Tensor] | None = None

    def next(self) -> torch.Tensor:
        if self._it is None:
            self._it = iter(self.loader)
        return next(self._it)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._it = None


def test_an_excisions_survivors_continue_a_lost_ranks_loader_where_it_left_off():
    from meshpact.live.recovery.reshard import adopt_objects
    from meshpact.live.recovery.state import SCHEDULE_KEY

    model, opt = _job()
    lost = _Stream(0)
    for _ in range(3):
        lost.next()
    committed = job_state(model, opt, objects={"data": lost})[SCHEDULE_KEY]  # its copy, at its last commit
    expected = [lost.next() for _ in range(4)]  # what rank 0 would have read next
    survivor: dict = {"data": _Stream(1)}
    adopt_objects(survivor, {0: committed}, lambda rank: {"data": _Stream(rank)})
    assert sorted(survivor) == ["data", "data@rank0"]
    got = [survivor["data@rank0"].next() for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected[:2]))
    # that survivor lost in turn: the next one takes rank 0's loader under rank 0's name, and its own
    carried = job_state(model, opt, objects=survivor)[SCHEDULE_KEY]
    last: dict = {"data": _Stream(2)}
    adopt_objects(last, {1: carried}, lambda rank: {"data": _Stream(rank)})
    assert sorted(last) == ["data", "data@rank0", "data@rank1"]
    assert all(torch.equal(last["data@rank0"].next(), b) for b in expected[2:3])
