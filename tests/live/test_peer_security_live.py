"""A real job's peer servers under attack, and a held copy corrupted before a kill.

One short trial (3 ranks, 4 steps, each rank's copies on both others, rank 0 killed at step 2;
its fault-free reference run and its faulted run) serves every assertion. The workload is the
user's loop with two additions, run inside the rank processes: rank 2, as a client without
the job key, attacks every rank's peer server at step 1 of each run (reads with step -1 and at
the real steps, puts at the real step whose schedule is a pickle that would write a file, puts
at far-future steps); rank 1 flips one bit of every copy of rank 0 it keeps, after the copy
arrived and passed its digest, as failing memory would. The killed rank's replacement must
refuse rank 1's copy, take rank 2's, and end bit-identical to the fault-free run; no attack may
read a byte or change what any server holds. At depth 1 a commit's copy lands on both holders
before the next step begins, so the kill never races the copy rank 2 is to give; the run is
also the depth-1 kill (half the host memory): restored from a peer, nothing read from storage.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from _recovery import assert_identical, trial, workload_file
from meshpact.core.recording import EventKind

pytestmark = [pytest.mark.live, pytest.mark.slow]

WORKLOAD = textwrap.dedent('''
    import json, os, pickle, socket, struct, threading
    from pathlib import Path

    import torch
    from torch.distributed.fsdp import fully_shard

    from meshpact.live.recovery.jobkey import draw
    from meshpact.live.recovery.peers import PeerError, fetch, put, serialize

    OUT = Path(__OUT__)

    def build(mesh):
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def batch(step, rank):
        return {"step": step, "x": torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))}

    def _own(name):
        """This rank's peer server or copier, found by its thread (the workload is handed neither)."""
        return next(t._target.__self__ for t in threading.enumerate() if t.name == name)

    class _WritesFile:
        def __reduce__(self):
            return (open, (str(OUT / "pwned"), "w"))

    def _raw(addr, header, body=b""):
        """A stranger's request: the challenge read, a header with a made-up tag; what came back after."""
        with socket.create_connection((addr.addr, addr.port), timeout=5.0) as sock:
            got = b""
            while len(got) < 40:
                got += sock.recv(40 - len(got))
            raw = json.dumps({**header, "nonce": "00" * 32}).encode()
            try:
                sock.sendall(struct.pack("!I", len(raw)) + raw + os.urandom(32) + body)
            except OSError:
                pass
            sock.settimeout(5.0)
            out = b""
            try:
                while chunk := sock.recv(65536):
                    out += chunk
            except OSError:
                pass
            return len(out)

    def _attack(step):
        server, copier = _own("meshpact-peer-server"), _own("meshpact-peer-ship")
        before = server.holds()
        pickled = pickle.dumps(_WritesFile())
        poison = serialize(step, {"param/x": torch.zeros(4),
                                  "schedule/state": torch.frombuffer(bytearray(pickled), dtype=torch.uint8)})
        stranger = draw().derive("peer")
        report = {}
        for r, addr in sorted(copier.addresses.items()):
            got = [_raw(addr, {"op": "get", "src": src, "step": s, "n": 0})
                   for src in range(3) for s in (-1, step - 1, step)]
            got += [_raw(addr, {"op": "put", "src": src, "step": s, "n": len(poison), "digest": "00" * 32}, poison)
                    for src in range(3) for s in (step, 10**6, 10**6 + 1)]
            refused = 0
            for call in (lambda: fetch(addr, 0 if r else 1, step, 5.0, key=stranger),
                         lambda: put(addr, 0 if r else 1, step, poison, 5.0, key=stranger),
                         lambda: put(addr, 0 if r else 1, 10**6, poison, 5.0, key=stranger)):
                try:
                    call()
                except PeerError:
                    refused += 1
            report[r] = {"bytes_read": got, "library_refused": refused}
        run = os.environ.get("MESHPACT_RUN_ID", "run")
        (OUT / f"attack-{run}.json").write_text(json.dumps({"report": report, "before": before,
                                                            "after": server.holds()}))

    def _corrupt_copies_of(src):
        """Flip one bit of each copy of ``src`` this rank's server keeps, once it is kept (verified)."""
        server = _own("meshpact-peer-server")
        keep = server._put

        def flipping(conn, header, context):
            keep(conn, header, context)
            if header.get("src") == src:
                with server._lock:
                    held = server._copies.get(src, {}).get(header.get("step"))
                if held is not None:
                    held.payload[len(held.payload) // 2] ^= 0x04
                    with open(OUT / "flipped.txt", "a") as f:
                        f.write(f"{header.get('step')}\\n")

        server._put = flipping

    def train_step(model, optimizer, batch):
        rank, first = int(os.environ["RANK"]), os.environ.get("MESHPACT_INCARNATION", "0") == "0"
        server = _own("meshpact-peer-server")
        with open(OUT / f"holds-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": batch["step"], "holds": server.holds()}) + "\\n")
        if rank == 1 and first and not hasattr(server, "_test_flipping"):
            server._test_flipping = True
            _corrupt_copies_of(0)
        run = os.environ.get("MESHPACT_RUN_ID", "run")
        if rank == 2 and first and batch["step"] == 1 and not (OUT / f"attack-{run}.json").exists():
            _attack(batch["step"])
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)
''')


def test_a_stranger_reads_and_changes_nothing_and_a_corrupted_copy_falls_back_to_the_next_holder(tmp_path_factory):
    out = tmp_path_factory.mktemp("attack")
    workload = workload_file(tmp_path_factory, "attacked", WORKLOAD.replace("__OUT__", repr(str(out))))
    result = trial(
        ranks=3,
        steps=4,
        faults=1,
        fault_kind="kill",
        peer_copies=2,
        peer_copy_depth=1,
        checkpoint_every=4,
        baselines=False,
        workload=workload,
    )
    assert [(f.rank, f.step) for f in result.faults] == [(0, 2)]
    s = assert_identical(result, faults_recovered=1, peer_restore=1, checkpoint_restore=0)
    assert s["storage_bytes_read"] == 0

    # (a) no byte of state left any server, nothing was put, no payload ran
    attacks = [json.loads(p.read_text()) for p in sorted(out.glob("attack-*.json"))]
    assert len(attacks) == 2  # the reference run's and the faulted run's
    for attack in attacks:
        assert sorted(attack["report"]) == ["0", "1", "2"]
        for r, seen in attack["report"].items():
            assert seen["bytes_read"] == [0] * 18 and seen["library_refused"] == 3, (r, seen)
        # rank 2's own server during the attack: what it held stays held (or is replaced by the source's next
        # genuine copy, landing meanwhile), and nothing the attack sent was kept
        before, after = ({tuple(h) for h in attack[k]} for k in ("before", "after"))
        assert before and after <= {(src, s) for src in (0, 1) for s in (0, 1)}, attack
        assert all(any(a == src and t >= s for a, t in after) for src, s in before), attack
    assert not (out / "pwned").exists()
    for path in out.glob("holds-rank*.jsonl"):
        for line in path.read_text().splitlines():
            held = json.loads(line)
            assert all(src in (0, 1, 2) and held["step"] - 1 <= step <= held["step"] for src, step in held["holds"]), (
                path.name,
                held,
            )

    # (c) rank 1's copies were corrupted; the replacement refused rank 1's and restored from rank 2's
    assert (out / "flipped.txt").read_text().split()
    (reloaded,) = [e for e in result.events() if e.event == EventKind.RELOADED and e.rank == 0]
    assert reloaded.data["holder"] == 2, reloaded.data
    (why,) = reloaded.data["refused"]
    assert why.startswith("rank 1:") and "fails its digest" in why, why
