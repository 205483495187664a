"""A rank's state: generators captured and restored exactly; the commit check costs O(1) bytes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from meshpact.live.recovery.state import (capture_rng, commit_check, restore_rng, rng_from_tensors,
                                          rng_tensors)


def _draws() -> tuple:
    return (torch.rand(3).tolist(), torch.nn.functional.dropout(torch.ones(8), 0.5).tolist(), random.random(),
            np.random.rand(2).tolist(), random.gauss(0, 1))


def test_restoring_the_generators_replays_every_draw_bit_for_bit():
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state: it must be kept too
    saved = capture_rng()
    first = _draws()
    assert _draws() != first  # the generators moved on
    restore_rng(saved)
    assert _draws() == first


def test_the_generators_survive_a_trip_through_tensors_as_a_checkpoint_stores_them():
    random.gauss(0, 1)
    np.random.standard_normal()
    saved = rng_tensors(capture_rng())
    first = _draws()
    restore_rng(rng_from_tensors({k: v.clone() for k, v in saved.items()}))
    assert _draws() == first
    assert all(k.startswith("rng/") for k in saved)


def test_commit_check_sees_a_written_tensor_and_the_committed_step():
    state = {f"param/w{i}": torch.arange(100, dtype=torch.float32) + i for i in range(5)}
    state["optim/w0/step"] = torch.tensor(3.0)
    check = commit_check(7, state)
    assert commit_check(7, {k: v.clone() for k, v in state.items()}) == check
    assert commit_check(8, state) != check
    state["param/w3"].add_(1.0)  # an optimizer step that ran part-way writes whole tensors
    assert commit_check(7, state) != check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float64])
def test_commit_check_hashes_a_bounded_sample_whatever_the_state_size(monkeypatch, dtype):
    hashed: list[int] = []
    import hashlib

    real = hashlib.blake2b

    class Counting:
        def __init__(self, *a, **kw):
            self.h = real(*a, **kw)

        def update(self, data):
            hashed.append(len(memoryview(data).cast("B")))
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(hashlib, "blake2b", Counting)
    small = {f"t{i}": torch.zeros(10, dtype=dtype) for i in range(3)}
    big = {f"t{i}": torch.zeros(50_000, dtype=dtype) for i in range(600)}
    commit_check(1, small)
    small_bytes = sum(hashed)
    hashed.clear()
    commit_check(1, big)
    assert sum(hashed) <= 64 * 3 * 2 * 8 + 64  # at most 64 tensors x 3 x 2 elements x 8 bytes, plus markers
    assert small_bytes < sum(hashed)
