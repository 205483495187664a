"""A job on a fleet of servers: failures, repairs, standbys and pools, replicated to an interval.

The cluster model of :mod:`meshpact.core.fleet` (AIReSim's, in this project's terms), run as
SimPy processes: one job process and one process per repair. The job process:

1. *Host selection.* The job takes ``job_servers`` servers and up to ``warm_standbys`` more
   from the working pool (by the fleet's :class:`~meshpact.core.fleet.HostSelection`).
   With fewer than ``job_servers`` there, it takes servers from the spare pool one at a
   time (``preemption_minutes`` each) until the pool holds the job and its standbys; with
   the spare pool empty it stalls until a repair returns a server (or ends the run,
   *depleted*, when retirements left too few servers in the fleet). Then
   ``host_selection_minutes`` pass.
2. *Run.* The job's servers run until the first of them fails or the work is done. Only
   the job's servers fail; standbys and idle servers do not. The first failure among the
   job's servers is drawn in O(1) whatever their number: the minimum of ``n`` independent
   times with one law is drawn by inverting its distribution, ``1 - (1 - F)^n``, once per
   class (good, bad), as each time to failure is drawn afresh at every restart.
3. *Failure.* The failed server leaves the working pool; diagnosis may miss (it returns
   unrepaired) or blame another of the job's servers (that one goes to repair; the failed
   one keeps running). The job recovers for the policy's downtime (a :class:`FleetCharge`);
   a policy that rolls back loses the work since its last checkpoint. The blamed server is
   replaced by the first warm standby and the job runs on; with no standby left it goes
   back to host selection.

A repair is automatic (exponential, ``auto_repair_minutes``), then with
``escalate_probability`` manual (exponential, ``manual_repair_minutes``); it fixes a bad
server unless it only reports success (``auto_false_success``, ``manual_false_success``).
A repaired server is retired by the fleet's retirement policy or goes back to the working
pool, where it refills the job's standbys when they are short.

Work counts toward the job while it runs: the effective training ratio is the work over the
wall time to finish it. :func:`replicate` runs replications until the Student-t interval of
both the time to finish and that ratio is within a relative tolerance of the mean.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, replace
from statistics import NormalDist, fmean, stdev
from typing import Any, Callable, Generator, Mapping, Sequence

import simpy

from meshpact.core.errors import ScenarioError
from meshpact.core.fleet import FailureDistribution, FleetSpec, HostSelection, Retirement
from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import (
    DEFAULT_RECOVERY_COSTS,
    FaultImpact,
    RecoveryCosts,
    estimate_recovery,
    peer_copy_seconds_per_step,
    policy_model,
)

from .workload import Workload

__all__ = [
    "FleetCharge",
    "FleetRun",
    "Estimate",
    "FleetResult",
    "FleetComparison",
    "fleet_charge",
    "run_fleet",
    "replicate",
    "simulate_fleet",
    "combine_adjust",
    "t_quantile",
    "check_fleet_bounds",
    "MAX_FLEET_FAILURES",
    "MAX_REPLICATIONS",
]

MAX_FLEET_FAILURES = 2_000_000  # expected failures of one replication, checked before it runs
MAX_REPLICATIONS = 10_000
_WORK, _REPAIR, _SPARE, _RETIRED = 0, 1, 2, 3
_OFF, _ACTIVE, _STANDBY = 0, 1, 2
_NORMAL = NormalDist()
StageAdjust = Callable[[Policy, int, Mapping[Stage, float]], Mapping[Stage, float]]


@dataclass(frozen=True)
class FleetCharge:
    """What one failure costs the job under ``policy``."""

    policy: Policy
    downtime_s: float  # the recovery, every failure
    rollback_every_s: float | None = None  # the work since the last checkpoint (one every so much work) is lost
    slowdown: float = 0.0  # wall seconds added per second of work (a peer copy every step)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.value,
            "downtime_s": self.downtime_s,
            "rollback_every_s": self.rollback_every_s,
            "slowdown": self.slowdown,
        }


@dataclass(frozen=True)
class FleetRun:
    """One replication: where the wall time went, in hours, and what the fleet did."""

    seed: int
    finish_h: float  # wall time to finish the work (or to depletion)
    work_h: float  # the work, once
    compute_h: float  # time the job ran, work lost to rollbacks included
    recovery_h: float
    host_selection_h: float
    preemption_h: float
    stalled_h: float  # waiting for a repair with the spare pool empty
    failures: int
    systematic_failures: int
    host_selections: int
    preemptions: int
    auto_repairs: int
    manual_repairs: int
    fixed: int  # repairs that fixed a bad server
    false_successes: int  # repairs that reported success and left the fault
    retired: int
    depleted: bool

    @property
    def effective_training_ratio(self) -> float:
        return 0.0 if self.depleted or self.finish_h <= 0 else self.work_h / self.finish_h

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["effective_training_ratio"] = self.effective_training_ratio
        return d


def _t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's T with ``df`` degrees of freedom (Abramowitz and Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:
        term = total = 1.0
        for k in range(2, df - 1, 2):
            term *= c2 * (k - 1) / k
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0
    for k in range(3, df - 1, 2):
        term *= c2 * (k - 1) / k
        total += term
    return 2 / math.pi * (theta + s * math.cos(theta) * total)


def t_quantile(p: float, df: int) -> float:
    """Student t quantile for ``p`` in (0.5, 1): exact by bisection up to 200 degrees of freedom,
    above them the Cornish-Fisher expansion about the normal (error under 1e-6)."""
    if df < 1 or not 0.5 < p < 1:
        raise ValueError("t_quantile: expected df >= 1 and p in (0.5, 1)")
    z = _NORMAL.inv_cdf(p)
    if df > 200:
        z3, z5, z7 = z**3, z**5, z**7
        return (
            z
            + (z3 + z) / (4 * df)
            + (5 * z5 + 16 * z3 + 3 * z) / (96 * df**2)
            + (3 * z7 + 19 * z5 + 17 * z3 - 15 * z) / (384 * df**3)
        )
    lo, hi, want = z, max(2 * z, 1.0), 2 * p - 1
    while _t_central(hi, df) < want:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, df) < want else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Estimate:
    """A mean over replications with its two-sided Student-t interval."""

    mean: float
    half_width: float
    n: int
    confidence: float

    @classmethod
    def of(cls, values: Sequence[float], confidence: float) -> "Estimate":
        n = len(values)
        m = fmean(values)
        hw = t_quantile(0.5 + confidence / 2, n - 1) * stdev(values) / math.sqrt(n) if n > 1 else math.inf
        return cls(m, hw, n, confidence)

    @property
    def relative_half_width(self) -> float:
        return self.half_width / abs(self.mean) if self.mean else math.inf

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def to_dict(self) -> dict[str, float]:
        return {
            "mean": self.mean,
            "half_width": self.half_width,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "confidence": self.confidence,
        }


@dataclass(frozen=True)
class FleetResult:
    """One policy's replications and the estimates the stopping rule judged."""

    charge: FleetCharge
    runs: tuple[FleetRun, ...]
    finish_h: Estimate
    effective_training_ratio: Estimate
    tolerance: float
    converged: bool  # both intervals within the tolerance before the cap on replications

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.charge.policy.value,
            "charge": self.charge.to_dict(),
            "replications": len(self.runs),
            "finish_h": self.finish_h.to_dict(),
            "effective_training_ratio": self.effective_training_ratio.to_dict(),
            "tolerance": self.tolerance,
            "converged": self.converged,
            "failures_mean": fmean(r.failures for r in self.runs),
            "depleted": sum(r.depleted for r in self.runs),
        }


def fleet_charge(
    policy: Policy | str,
    fleet: FleetSpec,
    workload: Workload | None = None,
    costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS,
    adjust: StageAdjust | None = None,
) -> FleetCharge:
    """The cost of one server failure under ``policy``.

    ``cold_restart`` is the fleet's ``recovery_minutes``, all in (AIReSim's recovery: no
    work is lost beyond it). Every other policy pays the cost model's stages for a rank loss
    on ``job_servers * ranks_per_server`` ranks (``adjust`` applies calibrated stages, as
    ``--calibrate-from`` does), the wait for a replacement excluded (the fleet's standbys and
    host selection model it); a policy that restores the checkpoint after a rank loss loses
    the work since the last one (every ``checkpoint_every`` steps of ``workload``), and
    ``peer_restore`` pays its copy every step. Without a workload those two are not known and
    the policy is refused.
    """
    policy = Policy(policy)
    if policy is Policy.COLD_RESTART:
        return FleetCharge(policy, fleet.recovery_minutes * 60.0)
    model = policy_model(policy)
    ranks = fleet.job_servers * fleet.ranks_per_server
    if workload is None:
        raise ScenarioError(
            f"policy {policy.value}: needs a workload (step time, shard, checkpoint interval); "
            "give a scenario with a workload section"
        )
    costs = replace(
        costs,
        state_bytes_per_rank=workload.state_bytes_per_rank,
        checkpoint_read_bytes_per_s=workload.reload_bytes_per_s or costs.checkpoint_read_bytes_per_s,
    )
    d = dict(
        estimate_recovery(
            policy, ranks, costs, impact=FaultImpact.RANK_LOSS, step_s=workload.step_s, replacement_s=0.0
        ).durations_s
    )
    if adjust is not None:
        reload = d.get(Stage.STATE) if model.from_checkpoint(FaultImpact.RANK_LOSS) else None
        d.update({s: v for s, v in adjust(policy, ranks, d).items() if s is not Stage.REPLAY})
        if reload is not None:  # a recording of a transient fault measured no checkpoint reload
            d[Stage.STATE] = reload
    downtime = sum(v for s, v in d.items() if s is not Stage.REPLAY)
    rollback = workload.checkpoint_every * workload.step_s if model.from_checkpoint(FaultImpact.RANK_LOSS) else None
    slowdown = (
        peer_copy_seconds_per_step(workload.state_bytes_per_rank, workload.step_s, costs) / workload.step_s
        if model.peer_copies
        else 0.0
    )
    return FleetCharge(policy, downtime, rollback, slowdown)


def check_fleet_bounds(fleet: FleetSpec, charge: FleetCharge, source: str = "fleet") -> None:
    """Refuse a replication whose failures would make it unbounded in practice: too many
    expected failures, or checkpoints so far apart that a rollback policy seldom finishes one."""
    per_min = fleet.failures_per_server_day / 1440.0
    bad = 1.0 if fleet.bad_regeneration_days else fleet.bad_fraction  # regeneration may turn every server bad
    job_rate = fleet.job_servers * per_min * (1.0 + fleet.bad_multiplier * bad)  # failures per job minute, at most
    expected = job_rate * fleet.work_days * 1440.0 * (1.0 + charge.slowdown)
    if expected > MAX_FLEET_FAILURES:
        raise ScenarioError(
            f"{source}: failures_per_server_day: {fleet.failures_per_server_day:g} on {fleet.job_servers} servers for "
            f"{fleet.work_days:g} days gives up to {expected:.3g} failures, over the limit of {MAX_FLEET_FAILURES:,}; "
            "lower the rate, the servers or the work"
        )
    if charge.rollback_every_s is not None:
        per_interval = job_rate * charge.rollback_every_s / 60.0 * (1.0 + charge.slowdown)
        if per_interval > 8.0:  # an interval survives with probability about e^-8: thousands of tries each
            raise ScenarioError(
                f"{source}: {charge.policy.value} rolls back to a checkpoint every {charge.rollback_every_s:g} s of work, "
                f"but the job fails about {per_interval:.3g} times in that long, so it would seldom finish one; "
                "checkpoint more often (checkpointing.every_steps) or lower the failure rate"
            )


class _Bag:
    """A set with O(1) add, remove and uniform choice."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[int] = []
        self.pos: dict[int, int] = {}

    def add(self, x: int) -> None:
        self.pos[x] = len(self.items)
        self.items.append(x)

    def discard(self, x: int) -> None:
        i = self.pos.pop(x, None)
        if i is None:
            return
        last = self.items.pop()
        if last != x:
            self.items[i] = last
            self.pos[last] = i

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, x: int) -> bool:
        return x in self.pos


class _Fleet:
    """One replication of ``fleet`` under ``charge`` (times in minutes inside)."""

    def __init__(self, fleet: FleetSpec, charge: FleetCharge, seed: int) -> None:
        self.f, self.c, self.seed = fleet, charge, seed
        self.rng = random.Random(seed)
        self.env = simpy.Environment()
        n = fleet.servers
        order = list(range(n))
        self.rng.shuffle(order)
        nbad = int(n * fleet.bad_fraction)
        self.bad = [False] * n
        for i in order[:nbad]:
            self.bad[i] = True
        self.where = [_WORK] * n
        self.stamp = [0] * n
        for k, i in enumerate(order[: fleet.working_pool]):
            self.stamp[i] = k
        self.next_stamp = fleet.working_pool
        self.spare: deque[int] = deque(order[fleet.working_pool :])
        for i in self.spare:
            self.where[i] = _SPARE
        self.n_working = fleet.working_pool
        self.role = [_OFF] * n
        self.act_bad, self.act_good = _Bag(), _Bag()
        self.standbys: deque[int] = deque()
        self.failures = [0] * n
        self.fail_times: dict[int, list[float]] = {}
        ret = fleet.retirement
        self.score_on = ret.policy is Retirement.SCORE
        self.score_base = [ret.initial_score] * n if self.score_on else []
        self.score_join = [0.0] * n if self.score_on else []
        self.credit = 0.0
        self.non_retired = n
        self.repaired = self.env.event()
        base = fleet.failures_per_server_day / 1440.0
        self.rate = (base, base * (1.0 + fleet.bad_multiplier))  # good, bad
        self.rollback_min = None if charge.rollback_every_s is None else charge.rollback_every_s / 60.0
        self.progress = 0.0  # work done, minutes
        self.t = dict(compute=0.0, recovery=0.0, host=0.0, preempt=0.0, stall=0.0)
        self.n = dict(failures=0, systematic=0, hosts=0, preemptions=0, auto=0, manual=0, fixed=0, false=0, retired=0)
        self.depleted = False

    # --- the job's servers ---------------------------------------------------------------
    def _join(self, i: int) -> None:
        self.role[i] = _ACTIVE
        (self.act_bad if self.bad[i] else self.act_good).add(i)
        if self.score_on:
            self.score_join[i] = self.credit

    def _leave(self, i: int) -> None:
        if self.role[i] == _ACTIVE:
            self.act_bad.discard(i)
            self.act_good.discard(i)
            if self.score_on:
                self.score_base[i] += self.credit - self.score_join[i]
        self.role[i] = _OFF

    def _score(self, i: int) -> float:
        s = self.score_base[i]
        return s + (self.credit - self.score_join[i]) if self.role[i] == _ACTIVE else s

    def _to_working(self, i: int) -> None:
        if self.where[i] != _WORK:
            self.where[i] = _WORK
            self.n_working += 1
        self.stamp[i] = self.next_stamp
        self.next_stamp += 1

    def _offer_standby(self, i: int) -> None:
        if len(self.standbys) < self.f.warm_standbys:
            self.standbys.append(i)
            if self.role[i] == _OFF:
                self.role[i] = _STANDBY

    def _select(self) -> bool:
        f = self.f
        pool = [i for i, w in enumerate(self.where) if w == _WORK]
        if len(pool) < f.job_servers:
            return False
        need = min(f.needed, len(pool))
        if f.host_selection is HostSelection.POOL_ORDER:
            chosen = sorted(pool, key=self.stamp.__getitem__)[:need]
            self.rng.shuffle(chosen)
        elif f.host_selection is HostSelection.RANDOM:
            chosen = self.rng.sample(pool, need)
        else:
            chosen = sorted(pool, key=lambda i: (self.failures[i], self.rng.random()))[:need]
        for i in list(self.act_bad.items) + list(self.act_good.items) + list(self.standbys):
            self._leave(i)
        self.standbys.clear()
        for i in chosen[: f.job_servers]:
            self._join(i)
        for i in chosen[f.job_servers :]:
            self.standbys.append(i)
            self.role[i] = _STANDBY
        self.n["hosts"] += 1
        return True

    # --- the first failure among the job's servers ---------------------------------------
    def _min_time(self, n: int, rate: float) -> float:
        if n == 0 or rate <= 0:
            return math.inf
        f, rng = self.f, self.rng
        if f.distribution is FailureDistribution.EXPONENTIAL:
            return rng.expovariate(n * rate)
        mean = 1.0 / rate
        if f.distribution is FailureDistribution.WEIBULL:
            k = f.weibull_shape
            return rng.weibullvariate(mean / math.gamma(1.0 + 1.0 / k) * n ** (-1.0 / k), k)
        s = f.lognormal_sigma
        p = -math.expm1(math.log(1.0 - rng.random()) / n)  # F(t) at the minimum of n
        p = min(max(p, 1e-300), 1.0 - 1e-16)
        return math.exp(math.log(mean) - 0.5 * s * s + s * _NORMAL.inv_cdf(p))

    def _first_failure(self) -> tuple[float, int | None]:
        good, bad = self.rate
        tg, tb = self._min_time(len(self.act_good), good), self._min_time(len(self.act_bad), bad)
        if tg == tb == math.inf:
            return math.inf, None
        bag = self.act_good if tg <= tb else self.act_bad
        return min(tg, tb), bag.items[self.rng.randrange(len(bag))]

    # --- processes ------------------------------------------------------------------------
    def _signal(self) -> None:
        if not self.repaired.triggered:
            self.repaired.succeed()

    def _retire(self, i: int) -> bool:
        r = self.f.retirement
        if r.policy is Retirement.THRESHOLD:
            since = self.env.now - r.window_days * 1440.0
            return sum(1 for t in self.fail_times.get(i, ()) if t >= since) >= r.max_failures
        if r.policy is Retirement.SCORE:
            return self._score(i) <= r.retire_at_or_below
        return False

    def _repair(self, i: int) -> Generator[simpy.Event, Any, None]:
        f, rng = self.f, self.rng
        yield self.env.timeout(rng.expovariate(1.0 / f.auto_repair_minutes) if f.auto_repair_minutes > 0 else 0.0)
        self.n["auto"] += 1
        if rng.random() >= f.escalate_probability:
            ok = rng.random() >= f.auto_false_success
        else:
            yield self.env.timeout(
                rng.expovariate(1.0 / f.manual_repair_minutes) if f.manual_repair_minutes > 0 else 0.0
            )
            self.n["manual"] += 1
            ok = rng.random() >= f.manual_false_success
        if ok:
            self.n["fixed"] += self.bad[i]
            self.bad[i] = False
        else:
            self.n["false"] += 1
        if self._retire(i):
            self.where[i] = _RETIRED
            self.non_retired -= 1
            self.n["retired"] += 1
        else:
            self._to_working(i)
            self._offer_standby(i)
        self._signal()

    def _regenerate(self) -> Generator[simpy.Event, Any, None]:
        f = self.f
        assert f.bad_regeneration_days is not None
        while True:
            yield self.env.timeout(f.bad_regeneration_days * 1440.0)
            good = [i for i, b in enumerate(self.bad) if not b and self.where[i] != _RETIRED]
            if not good:
                continue
            for i in self.rng.sample(good, min(max(1, int(len(good) * f.bad_fraction * 0.1)), len(good))):
                self.bad[i] = True
                if self.role[i] == _ACTIVE:
                    self.act_good.discard(i)
                    self.act_bad.add(i)

    def _failed(self, i: int) -> int:
        """Account a failure of ``i``; returns the server that leaves the job."""
        f, rng = self.f, self.rng
        self.n["failures"] += 1
        self.failures[i] += 1
        if self.bad[i] and rng.random() < f.bad_multiplier / (1.0 + f.bad_multiplier):
            self.n["systematic"] += 1
        if f.retirement.policy is Retirement.THRESHOLD:
            self.fail_times.setdefault(i, []).append(self.env.now)
        self.where[i] = _REPAIR
        self.n_working -= 1
        if f.diagnosis_probability < 1.0 and rng.random() >= f.diagnosis_probability:
            self._to_working(i)  # missed: back unrepaired
            self._offer_standby(i)
            self._signal()
            return i
        blamed = i
        if f.diagnosis_uncertainty > 0 and rng.random() < f.diagnosis_uncertainty:
            total = len(self.act_bad) + len(self.act_good)
            if total > 1:
                while blamed == i:
                    k = rng.randrange(total)
                    blamed = (
                        self.act_bad.items[k] if k < len(self.act_bad) else self.act_good.items[k - len(self.act_bad)]
                    )
                self.where[blamed] = _REPAIR
                self.n_working -= 1
                self._to_working(i)  # the failed server escapes and keeps running
                self._signal()
        if self.score_on:
            self.score_base[blamed] -= f.retirement.failure_penalty
        self.env.process(self._repair(blamed))
        return blamed

    def _credit(self, minutes: float, failed: int | None) -> None:
        r = self.f.retirement
        per = r.success_credit * (1 if r.success_period_days <= 0 else int(minutes / (r.success_period_days * 1440.0)))
        if per:
            self.credit += per
            if failed is not None:
                self.score_base[failed] -= per

    def job(self) -> Generator[simpy.Event, Any, None]:
        f, env, slow = self.f, self.env, 1.0 + self.c.slowdown
        remaining = f.work_days * 1440.0
        downtime = self.c.downtime_s / 60.0
        while remaining > 0:
            if not self._select():
                while self.n_working < f.needed:
                    if self.spare:
                        yield env.timeout(f.preemption_minutes)
                        self.t["preempt"] += f.preemption_minutes
                        self._to_working(self.spare.popleft())
                        self.n["preemptions"] += 1
                    else:
                        if self.non_retired < f.needed:
                            self.depleted = True
                            return
                        start = env.now
                        if not self.repaired.triggered:
                            yield self.repaired
                        self.repaired = env.event()
                        self.t["stall"] += env.now - start
                if not self._select():
                    continue
            yield env.timeout(f.host_selection_minutes)
            self.t["host"] += f.host_selection_minutes
            while remaining > 0:
                ttf, who = self._first_failure()
                if ttf >= remaining * slow:
                    yield env.timeout(remaining * slow)
                    self.t["compute"] += remaining * slow
                    self.progress += remaining
                    if self.score_on:
                        self._credit(remaining * slow, None)
                    remaining = 0.0
                    break
                yield env.timeout(ttf)
                self.t["compute"] += ttf
                remaining -= ttf / slow
                self.progress += ttf / slow
                assert who is not None
                if self.score_on:
                    self._credit(ttf, who)
                if self.n["failures"] >= MAX_FLEET_FAILURES:
                    raise ScenarioError(
                        f"fleet: {MAX_FLEET_FAILURES:,} failures before the work was done; the job "
                        "cannot finish at this failure rate: lower it or shorten the work"
                    )
                leaves = self._failed(who)
                yield env.timeout(downtime)
                self.t["recovery"] += downtime
                if self.rollback_min is not None:
                    lost = math.fmod(self.progress, self.rollback_min)
                    self.progress -= lost
                    remaining += lost
                self._leave(leaves)
                if self.standbys:
                    nxt = self.standbys.popleft()
                    self._join(nxt)
                    continue
                break

    def run(self) -> FleetRun:
        main = self.env.process(self.job())
        if self.f.bad_regeneration_days is not None:
            self.env.process(self._regenerate())
        self.env.run(until=main)
        t, n = self.t, self.n
        return FleetRun(
            seed=self.seed,
            finish_h=self.env.now / 60.0,
            work_h=self.f.work_days * 24.0,
            compute_h=t["compute"] / 60.0,
            recovery_h=t["recovery"] / 60.0,
            host_selection_h=t["host"] / 60.0,
            preemption_h=t["preempt"] / 60.0,
            stalled_h=t["stall"] / 60.0,
            failures=n["failures"],
            systematic_failures=n["systematic"],
            host_selections=n["hosts"],
            preemptions=n["preemptions"],
            auto_repairs=n["auto"],
            manual_repairs=n["manual"],
            fixed=n["fixed"],
            false_successes=n["false"],
            retired=n["retired"],
            depleted=self.depleted,
        )


def run_fleet(fleet: FleetSpec, charge: FleetCharge, seed: int = 0) -> FleetRun:
    """One replication of ``fleet`` under ``charge``."""
    check_fleet_bounds(fleet, charge)
    return _Fleet(fleet, charge, seed).run()


def replicate(
    fleet: FleetSpec,
    charge: FleetCharge,
    *,
    confidence: float = 0.95,
    tolerance: float = 0.01,
    min_runs: int = 5,
    max_runs: int = 200,
    seed: int = 0,
    progress: Callable[[int, FleetResult], None] | None = None,
) -> FleetResult:
    """Replications (seeds ``seed``, ``seed + 1``, ...) until both the time to finish and the
    effective training ratio have a ``confidence`` interval whose half-width is at most
    ``tolerance`` of the mean, after at least ``min_runs``; at most ``max_runs``."""
    if not 0 < confidence < 1:
        raise ScenarioError(f"confidence {confidence}: expected a level in (0, 1), e.g. 0.95")
    if not 0 < tolerance < 1:
        raise ScenarioError(f"tolerance {tolerance}: expected a relative half-width in (0, 1), e.g. 0.01")
    if not 2 <= min_runs <= max_runs <= MAX_REPLICATIONS:
        raise ScenarioError(f"replications {min_runs}..{max_runs}: expected 2 <= min <= max <= {MAX_REPLICATIONS}")
    check_fleet_bounds(fleet, charge)
    runs: list[FleetRun] = []
    while True:
        runs.append(_Fleet(fleet, charge, seed + len(runs)).run())
        if len(runs) < 2:
            continue
        fin = Estimate.of([r.finish_h for r in runs], confidence)
        etr = Estimate.of([r.effective_training_ratio for r in runs], confidence)
        ok = fin.relative_half_width <= tolerance and etr.relative_half_width <= tolerance
        res = FleetResult(charge, tuple(runs), fin, etr, tolerance, ok)
        if progress:
            progress(len(runs), res)
        if (ok and len(runs) >= min_runs) or len(runs) >= max_runs:
            return res


@dataclass(frozen=True)
class FleetComparison:
    """Every policy of a scenario on its fleet, each replicated to the same interval."""

    scenario: str
    fleet: FleetSpec
    results: Mapping[Policy, FleetResult]

    def to_frame(self) -> Any:
        """One row per policy: its charge, replications, and both estimates with their half-widths."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "policy": p.value,
                    "recovery_s": r.charge.downtime_s,
                    "rollback_every_s": r.charge.rollback_every_s,
                    "slowdown": r.charge.slowdown,
                    "replications": len(r.runs),
                    "converged": r.converged,
                    "finish_h": r.finish_h.mean,
                    "finish_h_half_width": r.finish_h.half_width,
                    "effective_training_ratio": r.effective_training_ratio.mean,
                    "effective_training_ratio_half_width": r.effective_training_ratio.half_width,
                    "failures": fmean(x.failures for x in r.runs),
                    "depleted": sum(x.depleted for x in r.runs),
                }
                for p, r in self.results.items()
            ]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "fleet": self.fleet.model_dump(mode="json"),
            "policies": {p.value: r.to_dict() for p, r in self.results.items()},
        }


def combine_adjust(*adjusts: tuple[Sequence[Policy], StageAdjust]) -> StageAdjust:
    """One stage adjustment from several, each applied to the policies it measured."""

    def adjust(policy: Policy, ranks: int, d: Mapping[Stage, float]) -> Mapping[Stage, float]:
        for policies, fn in adjusts:
            if policy in policies:
                return fn(policy, ranks, d)
        return d

    return adjust


def simulate_fleet(
    scenario: Any,
    *,
    fleet: FleetSpec | None = None,
    policies: Sequence[Policy | str] | None = None,
    adjust: StageAdjust | None = None,
    confidence: float = 0.95,
    tolerance: float = 0.01,
    min_runs: int = 5,
    max_runs: int = 200,
    seed: int = 0,
    progress: Callable[[Policy, int, FleetResult], None] | None = None,
) -> FleetComparison:
    """Replicate ``scenario``'s fleet (or ``fleet``) under each policy (default: the scenario's).

    The scenario's workload (at ``job_servers * ranks_per_server`` ranks), checkpointing and
    recovery costs price the policies other than cold restart. Every input is checked before
    the first replication runs.
    """
    from .workload import derive_workload

    fleet = fleet or scenario.fleet
    if fleet is None:
        raise ScenarioError(
            f"{scenario.name}: no fleet section; add one (see docs/simulator.md) or give --from-airesim FILE"
        )
    pols = [Policy(p) for p in dict.fromkeys(policies or scenario.recovery.policies)]
    workload = None
    if any(p is not Policy.COLD_RESTART for p in pols):
        workload = derive_workload(
            scenario.workload, scenario.checkpointing, fleet.job_servers * fleet.ranks_per_server, source=scenario.name
        )
    costs = scenario.recovery.recovery_costs(scenario.name)
    charges = [fleet_charge(p, fleet, workload, costs, adjust) for p in pols]
    for c in charges:
        check_fleet_bounds(fleet, c, scenario.name)
    results: dict[Policy, FleetResult] = {}
    for c in charges:
        cb = (lambda n, r, p=c.policy: progress(p, n, r)) if progress else None
        results[c.policy] = replicate(
            fleet,
            c,
            confidence=confidence,
            tolerance=tolerance,
            min_runs=min_runs,
            max_runs=max_runs,
            seed=seed,
            progress=cb,
        )
    return FleetComparison(scenario.name, fleet, results)
