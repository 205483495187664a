"""`meshpact live recover` refuses bad input with a message, exit 2, no traceback."""

from __future__ import annotations

from meshpact.cli import main


def test_bad_checkpoint_interval_is_a_user_error(capsys):
    assert main(["live", "recover", "--ranks", "2", "--steps", "5", "--checkpoint-every", "9"]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint-every must be between 1 and --steps (5)" in err and "Traceback" not in err


def test_more_faults_than_steps_is_a_user_error(capsys):
    assert main(["live", "recover", "--ranks", "2", "--steps", "5", "--faults", "9", "--checkpoint-every", "5"]) == 2
    assert "cannot place 9 fault(s)" in capsys.readouterr().err


def test_the_command_is_listed_under_live(capsys):
    main(["live", "--help"])
    assert "recover" in capsys.readouterr().out


def _configs(monkeypatch, *argvs: list[str]) -> list:
    """The TrialConfig each ``meshpact live recover <argv>`` hands to the trial (which is not run)."""
    import meshpact.live.trials.trial as trial

    seen = []

    class Stop(Exception):
        pass

    def fake_run_trial(cfg, recording_path):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(trial, "run_trial", fake_run_trial)
    for argv in argvs:
        try:
            main(["live", "recover", "--ranks", "2", "--faults", "1", *argv])
        except Stop:
            pass
    return seen


def test_heartbeat_is_on_unless_turned_off_and_reaches_the_trial(monkeypatch):
    base = ["--steps", "8", "--checkpoint-every", "4"]
    assert [c.heartbeat for c in _configs(monkeypatch, [*base, "--no-heartbeat"], base)] == [False, True]


def test_a_short_run_without_an_interval_checkpoints_at_its_end_instead_of_refusing(monkeypatch):
    """The default interval (10) is for runs of 10 steps or more: a shorter run gets one at its
    last step, where a flag the user never gave used to be refused; a given interval is kept."""
    configs = _configs(monkeypatch, ["--steps", "6"], ["--steps", "40"], ["--steps", "6", "--checkpoint-every", "2"])
    assert [c.checkpoint_every for c in configs] == [6, 10, 2]
