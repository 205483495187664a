"""Qwen3-14B's real dimensions across two native domains: the LM head (hidden 5120, vocabulary
151936) read four ways, and the MLP slice (intermediate 17408), on 2 + 2 gloo ranks in one run."""

from __future__ import annotations

import pytest

from _warm import shared_forkserver
from meshpact.live.plans.bridge import Job, run_bridge
from meshpact.live.plans.workloads import LiveRequest, get_preset

pytestmark = [pytest.mark.live, pytest.mark.slow]


@pytest.fixture(scope="module")
def report():
    return run_bridge([Job(r) for r in LiveRequest], "qwen3-14b", timeout_s=290, forkserver=shared_forkserver())


def test_qwen3_14b_preset_has_the_published_dimensions():
    p = get_preset("qwen3-14b")
    assert (p.hidden, p.vocab, p.intermediate, p.dtype.value) == (5120, 151936, 17408, "bfloat16")


def test_every_request_at_qwen3_14b_size_is_verified_with_planned_equal_to_measured(report):
    jobs = {j["request"]: j for j in report["jobs"]}
    assert set(jobs) == {r.value for r in LiveRequest}
    tokens = get_preset("qwen3-14b").tokens
    for name, job in jobs.items():
        assert job["verified"], (name, job["verification"])
        assert job["measured"]["startups"] == job["planned"]["startups"]
        assert job["measured"]["bytes_by_link"] == job["planned"]["bytes_by_link"]
    # full logits cross the bridge once (bf16, 2 bytes per logit); a token id crosses as 8 bytes
    assert jobs["full"]["measured"]["bytes_by_link"]["host_bridge"] == tokens * 151936 * 2
    assert jobs["token"]["measured"]["bytes_by_link"]["host_bridge"] == tokens * 8
    assert jobs["logprob"]["measured"]["bytes_by_link"]["host_bridge"] == tokens * 4
    # the MLP output crosses complete, once: [tokens, 5120] in bf16
    assert jobs["mlp"]["measured"]["bytes_by_link"]["host_bridge"] == tokens * 5120 * 2
    assert jobs["logprob"]["verification"]["equivalence"].startswith("tolerance(")
    assert 0 <= jobs["logprob"]["verification"]["max_abs_error"] < 1e-4
