"""The groups a recovery replaced are retired (their backends kept, their operations counted
until the next commit) once it resumed, and also where it failed after rebinding: a first
collective that raises must not leave the old backends to be freed on the failing path."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from meshpact.core.recovery import CommunicatorAction, Policy
from meshpact.live.recovery import pipeline
from meshpact.live.recovery.runtime import Resilient


def _job(monkeypatch, resume):
    retired: list[tuple[object, ...]] = []
    old = (object(), object())
    decision = SimpleNamespace(policy=Policy.IN_MEMORY, in_memory=True, step=3)
    monkeypatch.setattr(pipeline, "detect", lambda rt, cause: "detection")
    monkeypatch.setattr(pipeline, "agree_on", lambda rt, d: decision)
    monkeypatch.setattr(pipeline, "rebuild", lambda rt, d, dec: "rebuilt")
    rebound = pipeline.Rebound(0.0, 0.0, CommunicatorAction.REBUILD, old)
    monkeypatch.setattr(pipeline, "rebind", lambda rt, d, dec, b: rebound)
    monkeypatch.setattr(pipeline, "restore", lambda rt, d, dec: None)
    monkeypatch.setattr(pipeline, "resume", resume)
    monkeypatch.setattr(pipeline, "retire_replaced", lambda rt, rebound: retired.append(rebound.replaced))
    log = SimpleNamespace(deferred=contextlib.nullcontext, flush=lambda: None)
    job = SimpleNamespace(session=SimpleNamespace(log=log, sever_lock=threading.Lock()), on_decided=None, ckpt=None)
    return job, old, retired


def test_a_recovery_that_resumed_retires_the_groups_it_replaced(monkeypatch):
    job, old, retired = _job(monkeypatch, lambda rt, d, dec, rebound: None)
    Resilient._run_pipeline(job, pipeline.Cause("fault", 3))
    assert retired == [old]


def test_a_recovery_whose_first_collective_fails_still_retires_the_groups_it_replaced(monkeypatch):
    def resume(rt, d, dec, rebound):
        raise RuntimeError("Connection closed by peer")  # the first collective on the new groups

    job, old, retired = _job(monkeypatch, resume)
    with pytest.raises(RuntimeError, match="Connection closed"):
        Resilient._run_pipeline(job, pipeline.Cause("fault", 3))
    assert retired == [old]
