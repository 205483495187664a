"""Bad input gets one line naming the flag or field and its limit, exit 2, before any work.

Inputs are bounded where they enter (the scenario schema, the CLI's output paths, the
event budget of a run), so a value from a stranger's hand either runs or is refused; it
never hangs, allocates without bound or prints a traceback.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshpact.cli import main


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["simulate", *args])
    return rc, out.getvalue(), err.getvalue()


def assert_refused(rc: int, err: str, *names: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], err


@pytest.mark.parametrize(
    "args, names",
    [
        (["training", "--ranks", "10000000"], ["workload.ranks", "1048576"]),
        (["training", "--seed", "-1"], ["faults.seed", "0"]),
        (["training", "--days", "inf"], ["workload.days", "finite"]),
        (["training", "--days", "nan"], ["workload.days", "finite"]),
        (["training", "--days", "1e9"], ["workload.days", "3650"]),
        (["training", "--rank-mtbf-hours", "1e-9"], ["faults.rank_mtbf_hours", "200,000"]),
        (["training", "--ranks", "1048576", "--days", "3650"], ["checkpointing.every_steps", "1,000,000"]),
        (["training", "--checkpoint-every", "0"], ["checkpointing.every_steps"]),
        (["sweep", "--scenario", "default", "--param", "days=1,.inf"], ["workload.days", "finite"]),
        (["sweep", "--scenario", "default", "--param", "seed=-1"], ["faults.seed"]),
        (
            [
                "sweep",
                "--scenario",
                "default",
                "--param",
                "seed=" + ",".join(map(str, range(400))),
                "--param",
                "days=" + ",".join(str(1 + i / 1000) for i in range(400)),
            ],
            ["--param", "100,000"],
        ),
    ],
)
def test_malformed_flags_are_refused_in_one_line(args, names):
    rc, _, err = run_cli(*args)
    assert_refused(rc, err, *names)


def test_sweep_output_is_checked_before_the_sweep_runs(tmp_path, monkeypatch):
    import meshpact.simulator.sweep as sweep

    def never(*a, **k):  # the sweep must not start
        raise AssertionError("the sweep ran before its output name was checked")

    monkeypatch.setattr(sweep, "run_sweep", never)
    rc, _, err = run_cli("sweep", "--scenario", "default", "--param", "days=1", "--out", str(tmp_path / "x.txt"))
    assert_refused(rc, err, "--out", ".csv or .parquet")
    rc, _, err = run_cli("sweep", "--scenario", "default", "--param", "days=1", "--out", str(tmp_path / "no" / "x.csv"))
    assert_refused(rc, err, "--out", "does not exist")
    rc, _, err = run_cli("sweep", "--scenario", "default", "--param", "days=1", "--processes", "0")
    assert_refused(rc, err, "--processes")


def test_trace_into_a_missing_folder_is_refused_and_no_folder_is_made(tmp_path):
    target = tmp_path / "missing" / "deeper" / "run.json"
    rc, _, err = run_cli("training", "--days", "0.1", "--trace", str(target))
    assert_refused(rc, err, "--trace", "does not exist")
    assert not (tmp_path / "missing").exists()


def test_infinite_days_in_a_scenario_file_is_refused(tmp_path):
    f = tmp_path / "inf.yaml"
    f.write_text(
        "name: inf\ncluster:\n  domains:\n    - {name: a, vendor: cuda, host: h, ranks: 8}\n"
        "workload: {step_seconds: 1.0, days: .inf}\n"
    )
    rc, _, err = run_cli("training", "--scenario", str(f))
    assert_refused(rc, err, "inf.yaml", "workload.days")


# Values a stranger might type: ordinary, zero, negative, huge, tiny, infinite, not a number.
_NUMBERS = st.one_of(
    st.integers(min_value=-10, max_value=64),
    st.sampled_from([0, -1, 10**7, 10**12, 2**63, 1e-12, 1e-9, 1e9, 1e300, math.inf, -math.inf, math.nan]),
    st.floats(min_value=1e-3, max_value=50, allow_nan=False),
)
_FLAGS = {
    "--ranks": int,
    "--days": float,
    "--step-seconds": float,
    "--rank-mtbf-hours": float,
    "--checkpoint-every": int,
    "--checkpoint-seconds": float,
    "--seed": int,
    "--work-steps": int,
}


@pytest.fixture(autouse=True)
def small_budget(request, monkeypatch):
    """Fuzzed runs that are accepted stay short: the event budget is cut for them (the
    refusal logic is the same at any budget; the real limits are pinned above)."""
    if "fuzzed" in request.node.name:
        import meshpact.simulator.training as training

        monkeypatch.setattr(training, "MAX_CHECKPOINT_INTERVALS", 2_000)
        monkeypatch.setattr(training, "MAX_FAULTS", 500)


def _text(value: float | int, kind: type) -> str:
    if kind is int:
        return str(int(value)) if math.isfinite(value) else "0"
    return repr(float(value))


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(_FLAGS)), _NUMBERS, min_size=1, max_size=4))
def test_fuzzed_training_flags_run_or_are_refused_in_one_line(flags):
    # small horizons keep a run that is accepted short; the guards must hold at any size
    args = ["training", "--policy", "in_memory", "--json"]
    if "--days" not in flags:
        args += ["--days", "0.2"]
    for flag, value in flags.items():
        args += [flag, _text(value, _FLAGS[flag])]
    rc, out, err = run_cli(*args)
    if rc == 0:
        assert out.lstrip().startswith("{") and "Traceback" not in err
    else:
        assert_refused(rc, err)


_FIELDS = {
    "workload.days": _NUMBERS,
    "workload.ranks": _NUMBERS,
    "workload.step_seconds": _NUMBERS,
    "faults.rank_mtbf_hours": _NUMBERS,
    "faults.rank_loss_mtbf_hours": _NUMBERS,
    "faults.seed": _NUMBERS,
    "faults.repair_hours": _NUMBERS,
    "checkpointing.every_steps": _NUMBERS,
    "checkpointing.seconds": _NUMBERS,
    "faults.hang_mtbf_hours": _NUMBERS,
    "faults.node_fraction": _NUMBERS,
    "faults.rack_fraction": _NUMBERS,
    "faults.spare_ranks": _NUMBERS,
    "faults.ranks_per_node": _NUMBERS,
    "workload.step_time_cv": _NUMBERS,
    "workload.work_steps": _NUMBERS,
    "checkpointing.read_gbyte_per_s_per_rank": _NUMBERS,
}


@pytest.mark.slow
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(st.dictionaries(st.sampled_from(sorted(_FIELDS)), _NUMBERS, min_size=1, max_size=5))
def test_fuzzed_scenario_fields_run_or_are_refused_in_one_line(tmp_path, fields):
    import yaml

    data = {
        "name": "fuzz",
        "cluster": {"domains": [{"name": "a", "vendor": "cuda", "host": "h", "ranks": 8}]},
        "workload": {"days": 0.2, "step_seconds": 1.0},
        "recovery": {"policies": ["in_memory"]},
    }
    for path, value in fields.items():
        section, name = path.split(".")
        data.setdefault(section, {})[name] = value
    if "step_seconds" in data["workload"] and data["workload"]["step_seconds"] is None:
        del data["workload"]["step_seconds"]
    f = tmp_path / "fuzz.yaml"
    f.write_text(yaml.safe_dump(data))
    rc, out, err = run_cli("training", "--scenario", str(f), "--json")
    if rc == 0:
        assert out.lstrip().startswith("{") and "Traceback" not in err
    else:
        assert_refused(rc, err)
