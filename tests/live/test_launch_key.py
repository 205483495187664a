"""The job key ``meshpact launch`` hands its workers (:func:`~meshpact.live.elastic.launch_key`)."""

from __future__ import annotations

import pytest

from meshpact.live.elastic import LaunchRefused, launch_key, main
from meshpact.live.recovery.jobkey import KEY_ENV, KEY_FILE_ENV, UNAUTHENTICATED_ENV, draw, write_key_file


def test_a_job_of_one_node_gets_a_fresh_key_drawn_for_it():
    first, second = launch_key({}, 1), launch_key({}, 1)
    assert first is not None and second is not None and first.secret != second.secret
    assert first.source == "drawn by meshpact launch"


def test_the_users_key_is_taken_on_one_node_and_on_several(tmp_path):
    key = draw()
    for nodes in (1, 4):
        assert launch_key({KEY_ENV: key.secret.hex()}, nodes).secret == key.secret
    path = write_key_file(key, tmp_path / "keys" / "job")
    assert launch_key({KEY_FILE_ENV: str(path)}, 4).secret == key.secret


def test_several_nodes_without_a_key_are_refused_unless_the_user_opts_out_by_name():
    with pytest.raises(LaunchRefused, match=f"set {KEY_ENV} .* or {UNAUTHENTICATED_ENV}=1"):
        launch_key({}, 2)
    assert launch_key({UNAUTHENTICATED_ENV: "1"}, 2) is None
    with pytest.raises(LaunchRefused):
        launch_key({UNAUTHENTICATED_ENV: "yes"}, 2)  # only the named value opts out


def test_a_bad_key_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(LaunchRefused, match=f"{KEY_ENV}: expected 64 hex digits"):
        launch_key({KEY_ENV: "abc"}, 1)
    loose = tmp_path / "key"
    loose.write_text(draw().secret.hex())
    loose.chmod(0o644)
    with pytest.raises(LaunchRefused, match="lets others read it"):
        launch_key({KEY_FILE_ENV: str(loose)}, 2)


def test_meshpact_launch_on_two_nodes_without_a_key_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never started')\n")
    for name in (KEY_ENV, KEY_FILE_ENV, UNAUTHENTICATED_ENV):
        monkeypatch.delenv(name, raising=False)
    rc = main(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
               "--master-port", "1", str(script)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: a job of several nodes needs one job key"), lines
