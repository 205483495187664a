"""Plans run across two native domains of real processes (2 + 2 gloo ranks), verified and metered.

The four ranks start once for this module and run every job in one go: the five requests
(``full``, ``logprob``, ``token``, ``owner_token``, ``mlp``) with the lowerer's plans, two
plans the executor must refuse before running, and one whose declared bytes are wrong.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from _warm import shared_forkserver
from meshpact.core.contract import compile_contract
from meshpact.core.lowerer import lower
from meshpact.core.plan import Plan, Step
from meshpact.core.recording import read_recording
from meshpact.live.plans.bridge import Job, run_bridge
from meshpact.live.plans.domains import two_domain_mesh
from meshpact.live.plans.workloads import LiveRequest, get_preset, workload_edge

pytestmark = [pytest.mark.live, pytest.mark.slow]

REQUESTS = [r.value for r in LiveRequest]


def _cross_domain_plan() -> Plan:
    """All-gather the logits over all four ranks: one native collective spanning both domains."""
    return Plan(
        "live_full_tiny",
        "hand",
        (
            Step("collective", "all_gather", (0, 1, 2, 3), ("logits",), "all", 16000, "bfloat16", args={"dim": 1}),
            Step("deliver", "deliver", (2, 3), ("all",), "all", 0, "bfloat16"),
        ),
    )


def _unreduced_mlp_plan() -> Plan:
    """The lowerer's MLP plan without its reduce: rank 0 ships its own addend as if complete.

    Every step is local to a domain or a bridge message, so only the checker can see that a
    partial sum crosses unreduced."""
    edge = workload_edge(LiveRequest.MLP, get_preset("tiny"), two_domain_mesh())
    good = lower(compile_contract(edge))
    steps = [s for s in good.steps if s.op != "reduce"]
    send = steps[0]
    steps[0] = Step(
        send.kind, send.op, send.ranks, ("mlp_out",), send.output, send.payload_bytes, send.dtype, link=send.link
    )
    return Plan(good.edge, "hand", tuple(steps))


def _misdeclared_token_plan() -> Plan:
    """The lowerer's token plan with each bridge message declared 8 bytes heavier than it is."""
    edge = workload_edge(LiveRequest.TOKEN, get_preset("tiny"), two_domain_mesh())
    good = lower(compile_contract(edge))
    return Plan(
        good.edge,
        "hand",
        tuple(replace(s, payload_bytes=s.payload_bytes + 8) if s.kind.value == "send" else s for s in good.steps),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    jobs = [Job(LiveRequest(r)) for r in REQUESTS]
    jobs += [
        Job(LiveRequest.FULL, _cross_domain_plan().to_json(), "cross_domain"),
        Job(LiveRequest.MLP, _unreduced_mlp_plan().to_json(), "unreduced"),
        Job(LiveRequest.TOKEN, _misdeclared_token_plan().to_json(), "misdeclared"),
    ]
    path = tmp_path_factory.mktemp("bridge") / "bridge.jsonl"
    report = run_bridge(jobs, "tiny", recording=path, timeout_s=240, forkserver=shared_forkserver())
    return report, {j["label"]: j for j in report["jobs"]}


@pytest.mark.parametrize("request_name", REQUESTS)
def test_each_request_is_verified_under_the_contracts_equivalence(run, request_name):
    _, jobs = run
    job = jobs[request_name]
    assert job["refused"] is None
    ver = job["verification"]
    assert job["verified"] and ver["ok"], ver
    assert set(ver["per_rank"]) == {"2", "3"}
    if request_name == "logprob":  # distributed log-softmax sums in another order: a stated tolerance
        assert ver["equivalence"].startswith("tolerance(")
        assert all(v.startswith("within tolerance") for v in ver["per_rank"].values())
    else:
        assert ver["equivalence"] == "bitwise"
        assert all(v == "bitwise equal" for v in ver["per_rank"].values())


@pytest.mark.parametrize("request_name", REQUESTS)
def test_measured_startups_and_bytes_equal_the_plans_per_link_class(run, request_name):
    job = run[1][request_name]
    planned, measured = job["planned"], job["measured"]
    assert measured["startups"] == planned["startups"] > 0
    assert measured["payload_bytes"] == planned["payload_bytes"] > 0
    assert measured["bytes_by_link"] == planned["bytes_by_link"]
    assert measured["startups_by_link"] == planned["startups_by_link"]
    assert "host_bridge" in measured["bytes_by_link"]  # something really crossed the bridge
    assert job["cost_matches"]


def test_a_misdeclared_byte_count_is_refused_before_any_call(run):
    job = run[1]["misdeclared"]  # the checker recomputes byte counts from the buffers' shapes and dtypes
    assert job["refused"] and job["calls_made"] == 0
    assert any("payload_mismatch" in r for r in job["refused"])


def test_owner_tokens_reach_their_owner_only(run):
    job = run[1]["owner_token"]
    assert job["verification"]["owner_scope_leaks"] == []
    sends = [s for s in job["plan"]["steps"] if s["kind"] == "send"]
    assert sorted(s["ranks"][1] for s in sends) == [2, 3]  # one message to each owner, none relayed


def test_each_domain_gets_its_own_backend_and_only_bridges_cross(run):
    report, _ = run
    by_rank = {lay["rank"]: lay for lay in report["layouts"]}
    assert {by_rank[r]["domain"] for r in (0, 1)} == {"cuda@localhost"}
    assert {by_rank[r]["domain"] for r in (2, 3)} == {"cann@localhost"}
    for lay in by_rank.values():
        assert lay["backend"] == "gloo" and lay["stand_in"] and "stands in" in lay["reason"]
        assert all(sorted({(a < 2), (b < 2)}) == [False, True] for a, b in lay["bridges"])
    assert [0, 2] in by_rank[0]["bridges"] and [0, 2] in by_rank[2]["bridges"]


def test_executor_refuses_a_cross_domain_native_collective_without_attempting_it(run):
    job = run[1]["cross_domain"]
    assert job["refused"] and not job["verified"]
    assert any("spans domains" in r for r in job["refused"])
    assert job["calls_made"] == 0  # no rank made any call for it, and the run went on


def test_executor_refuses_a_plan_the_checker_rejects(run):
    job = run[1]["unreduced"]
    assert job["refused"] and job["calls_made"] == 0
    assert all(r.startswith("checker: ") for r in job["refused"])
    assert any("reduce" in r for r in job["refused"])


def test_the_run_is_recorded_as_jsonl_events(run):
    report, jobs = run
    events = read_recording(report["recording"])
    assert events[0].data["source"] == "live"
    calls = [e for e in events if e.event == "call"]
    sends = [e for e in calls if e.data["op"] == "send"]
    assert sum(e.data["contributed"] for e in sends) == sum(
        j["measured"]["bytes_by_link"].get("host_bridge", 0) for j in jobs.values() if j["refused"] is None
    )
    assert sum(e.event == "verified" for e in events) == len(REQUESTS)  # the misdeclared plan is refused
    assert [e.t for e in calls if e.data["job"] == 0] == sorted(e.t for e in calls if e.data["job"] == 0)
