"""A finished run's verdict names the reference it was compared with: an excised run is never
called equal to the fault-free run, and each downtime figure says what it includes."""

from __future__ import annotations

from meshpact.app.verdict import Tone, downtime_notes, run_verdict


def _excised(equal: bool = True, diff: float | None = 4.8e-05, refused: str | None = None) -> dict:
    return {
        "faults_injected": 1,
        "faults_from_page": 1,
        "bit_identical": equal,
        "mismatches": [] if equal else ["rank 0: layer.weight differs from the excising reference"],
        "downtime_s": {
            "in_memory": None,
            "peer_restore": None,
            "excise": 2.5,
            "checkpoint_restore": None,
            "cold_restart": None,
        },
        "downtime_includes": {
            "excise": "detection, consensus, the survivors' new groups, the re-shard",
            "checkpoint_restore": None,
        },
        "excision": {
            "excisions": [{"step": 3, "lost": [3]}],
            "equal_to_excising_reference": equal,
            "max_abs_diff_from_unfailed": diff,
            "refused": refused,
            "flushed_checkpoint": None,
        },
    }


def test_an_excised_run_is_judged_against_the_excising_reference_and_its_difference_from_the_fault_free_run():
    v = run_verdict(_excised())
    assert v.tone is Tone.SUCCESS
    assert "excising reference" in v.text and "without rank 3 from step 3" in v.text
    assert "4.8e-05" in v.text and "cannot equal" in v.text
    assert "equal the fault-free" not in v.text and "fault-free run's." not in v.text


def test_an_excised_run_that_differs_from_its_reference_is_an_error_naming_it():
    v = run_verdict(_excised(equal=False))
    assert v.tone is Tone.ERROR and v.text.startswith("**Not equal to the excising reference**")
    assert "layer.weight differs" in v.text


def test_a_refused_excision_is_an_error_and_an_unmeasured_difference_is_said():
    assert run_verdict(_excised(refused="below --min-ranks 2")).tone is Tone.ERROR
    assert "not compared with the fault-free run" in run_verdict(_excised(diff=None)).text


def test_a_run_that_kept_every_rank_is_judged_against_the_fault_free_run():
    summary = {"faults_injected": 2, "faults_from_page": 0, "bit_identical": True, "excision": None}
    v = run_verdict(summary)
    assert v.tone is Tone.SUCCESS and "fault-free reference" in v.text and "2 fault(s)" in v.text
    bad = run_verdict({**summary, "bit_identical": False, "mismatches": ["rank 1: w differs"]})
    assert bad.tone is Tone.ERROR and "rank 1: w differs" in bad.text


def test_each_downtime_figure_says_what_it_includes_and_why_the_baselines_are_missing():
    notes = downtime_notes(_excised(), baselines_asked=True)
    assert notes[0] == "**excise and continue** includes detection, consensus, the survivors' new groups, the re-shard."
    assert "Not measured in this run:" in notes[-1] and "An excising run measures no checkpoint baseline" in notes[-1]
    quiet = downtime_notes(_excised(), baselines_asked=False)
    assert "excising run" not in quiet[-1]
