"""Producer pieces of the live bridge workloads are kept between processes, never stale."""

from __future__ import annotations

import torch

from meshpact.live.plans import workloads
from meshpact.live.plans.jobs import get_preset


def _fresh(lm_head: bool, parts: int, index: int) -> torch.Tensor:
    workloads._producer_local.cache_clear()  # this process's own memory of it, as a new rank process has none
    return workloads._producer_local(lm_head, "tiny", parts, index)


def test_a_piece_is_computed_once_and_read_back_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr(workloads.tempfile, "gettempdir", lambda: str(tmp_path))
    first = _fresh(True, 2, 1)
    path = workloads._cached_path(True, get_preset("tiny"), 2, 1)
    assert path.is_file() and path.parent.parent == tmp_path
    computed = []
    real = workloads._one_thread

    def counting():
        computed.append(1)
        return real()

    monkeypatch.setattr(workloads, "_one_thread", counting)
    assert torch.equal(_fresh(True, 2, 1), first) and computed == []  # read, not computed
    path.write_bytes(b"cut short")  # a file a full disk cut: computed again, and the same
    assert torch.equal(_fresh(True, 2, 1), first) and computed == [1]
    assert torch.equal(torch.load(path, weights_only=True), first)  # and written whole again


def test_the_name_follows_the_preset_the_split_and_the_generators_source(monkeypatch):
    tiny = get_preset("tiny")
    names = {
        workloads._cached_path(True, tiny, 2, 0),
        workloads._cached_path(True, tiny, 2, 1),
        workloads._cached_path(False, tiny, 2, 0),
        workloads._cached_path(True, tiny, 4, 0),
        workloads._cached_path(True, get_preset("qwen3-14b"), 2, 0),
    }
    assert len(names) == 5
    before = workloads._cached_path(True, tiny, 2, 0)
    monkeypatch.setattr(workloads.inspect, "getsource", lambda f: "an edited generator " + f.__name__)
    assert workloads._cached_path(True, tiny, 2, 0) != before
