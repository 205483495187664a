"""The Mesh page's policy comparison: figures follow which ranks failed, not only how many."""

from __future__ import annotations

import csv
import io

import pytest

from meshpact.app.policies import POLICY_EXPLAINED, compare_policies, comparison_rows, failure_shape
from meshpact.core.facts import Domain, Mesh, Vendor
from meshpact.core.recovery import Policy

# Two hosts; hostA holds two domains of 8 ranks, hostB one of 4 whose bridge rank is 17.
MESH = Mesh(
    domains=(
        Domain("cuda@hostA", Vendor.CUDA, "hostA", tuple(range(8))),
        Domain("cpu@hostA", Vendor.CPU, "hostA", tuple(range(8, 16))),
        Domain("cann@hostB", Vendor.CANN, "hostB", (16, 17, 18, 19), bridge_rank=17),
    )
)


def _cmp(failed, rank_loss=False):
    return compare_policies(MESH, failed, rank_loss=rank_loss, steps_since_checkpoint=40, step_s=2.0)


def test_failure_shape_names_lost_domains_hosts_and_bridges():
    assert failure_shape(MESH, [3]).lost_domains == ()
    s = failure_shape(MESH, range(8, 16))
    assert s.lost_domains == ("cpu@hostA",) and s.lost_hosts == ()  # hostA still has cuda@hostA
    s = failure_shape(MESH, range(16))
    assert s.lost_hosts == ("hostA",)
    assert failure_shape(MESH, [17, 18]).failed_bridges == (17,)
    assert failure_shape(MESH, [18]).failed_bridges == ()


def test_a_lost_domain_takes_in_memory_and_excise_off_the_table_with_a_reason():
    one, whole = _cmp([19]), _cmp([16, 17, 18, 19])
    assert set(b.policy for b in one.breakdowns) == set(Policy)
    assert whole.total_s(Policy.IN_MEMORY) is None and whole.total_s(Policy.EXCISE) is None
    assert "cann@hostB" in whole.unavailable[Policy.IN_MEMORY]
    assert whole.downtime_reduction is None and whole.retained_ranks == 0
    assert whole.total_s(Policy.COLD_RESTART) > one.total_s(Policy.COLD_RESTART)  # a lost host is a rank loss


def test_a_lost_host_counts_as_a_rank_loss_even_with_the_toggle_off():
    assert _cmp(range(16, 20)).rank_loss is True
    assert _cmp([3]).rank_loss is False
    assert _cmp([3], rank_loss=True).rank_loss is True


def test_in_memory_grows_with_the_communicators_the_failed_ranks_belonged_to():
    inner, bridge = _cmp([18]), _cmp([17])  # same domain, one rank each; 17 also carries the bridge
    assert failure_shape(MESH, [17]).rebuild_ranks > failure_shape(MESH, [18]).rebuild_ranks
    assert bridge.total_s(Policy.IN_MEMORY) >= inner.total_s(Policy.IN_MEMORY)
    two_domains = _cmp([1, 9])
    assert two_domains.total_s(Policy.IN_MEMORY) > _cmp([1]).total_s(Policy.IN_MEMORY)
    assert two_domains.total_s(Policy.COLD_RESTART) == pytest.approx(_cmp([1]).total_s(Policy.COLD_RESTART))


def test_every_policy_is_explained_and_the_csv_has_a_row_per_policy():
    assert set(POLICY_EXPLAINED) == set(Policy)
    assert all(text.endswith(".") and len(text) > 40 for text in POLICY_EXPLAINED.values())
    rows = list(csv.DictReader(io.StringIO(_csv(_cmp([16, 17, 18, 19])))))
    assert [r["policy"] for r in rows] == [p.value for p in Policy]
    by = {r["policy"]: r for r in rows}
    assert by["in_memory"]["applies"] == "False" and "cann@hostB" in by["in_memory"]["why_not"]
    assert float(by["cold_restart"]["total_s"]) > 0


def test_no_failed_rank_is_refused():
    with pytest.raises(ValueError, match="no failed ranks"):
        _cmp([])


def _csv(cmp) -> str:
    import pandas as pd

    return pd.DataFrame(comparison_rows(cmp)).to_csv(index=False)
