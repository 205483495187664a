"""What ``meshpact launch`` does for a job's security: the job key it hands its workers
(:func:`~meshpact.live.launch.command.launch_key`) and the addresses its rendezvous stores listen on
(:func:`~meshpact.live.launch.rendezvous.rendezvous_handler`)."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from _sockets import listeners
from meshpact.live.trials.ports import unclaimed_port
from meshpact.live.launch.command import launch_key, main
from meshpact.live.launch.elastic import LaunchRefused
from meshpact.live.launch.rendezvous import rendezvous_handler
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
    rc = main(
        [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "static",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "1",
            str(script),
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: a job of several nodes needs one job key"), lines


def _listening(port: int) -> list:
    return [ln for ln in listeners(os.getpid()) if ln[2] == port]


def test_the_static_rendezvous_store_of_node_0_listens_on_master_addr_alone():
    port = unclaimed_port()
    handler = rendezvous_handler(RendezvousParameters("static", f"127.0.0.1:{port}", uuid.uuid4().hex, 2, 2, rank=0))
    assert [ln.wildcard for ln in _listening(port)] == [False]  # before: torch's TCPStore on 0.0.0.0
    del handler


def test_the_c10d_rendezvous_store_and_the_store_shared_with_the_workers_listen_on_loopback_under_standalone():
    params = RendezvousParameters("c10d", "localhost:0", uuid.uuid4().hex, 1, 1, local_addr="127.0.0.1")
    before = {ln[2] for ln in listeners(os.getpid())}
    handler = rendezvous_handler(params)
    shared = handler._create_tcp_store_server("127.0.0.1", 0)  # what group rank 0 makes at its first round
    made = [ln for ln in listeners(os.getpid()) if ln[2] not in before]
    # both stores listen, on loopback; and nothing this process made meanwhile listens on every interface
    # (a thread another test of this worker left may have opened a listener of its own: it is not counted)
    assert sorted(ln[2] for ln in made if ln[2] in (handler._store.port, shared.port)) == sorted(
        (handler._store.port, shared.port)
    ), made
    assert not [ln for ln in made if ln.wildcard], made
    del handler, shared


def test_a_warm_spares_assignment_which_carries_the_job_key_is_readable_by_its_user_alone(tmp_path):
    from meshpact.live.launch.warmspare import Assignment, assign

    target = tmp_path / "spare-0.json"
    assign(target, Assignment({"MESHPACT_JOB_KEY": "00" * 32}, ("-m", "x"), "", ""))
    assert target.stat().st_mode & 0o777 == 0o600
    assert Assignment.from_dict(json.loads(target.read_text())).env["MESHPACT_JOB_KEY"] == "00" * 32
