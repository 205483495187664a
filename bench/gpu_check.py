"""The one-GPU device check: the recovery's device primitives measured on a real CUDA device.

Run it with one command on a machine with one CUDA GPU::

    python bench/gpu_check.py            # table + one JSON line, also bench/results/gpu.json

On a machine without CUDA it says so in one line and exits 0 without writing anything. What it
measures (:mod:`meshpact.live.recovery.device` names each primitive):

| check | what it does | keys |
|---|---|---|
| NCCL abort and rebuild | a one-rank NCCL group: one allreduce, ``abort_groups``, a fresh group and its first allreduce | ``nccl_abort_ms``, ``nccl_rebuild_ms``, ``nccl_rebuilt_sum_ok`` |
| pinned async snapshot | 1 GB of state in 16 tensors copied to the host: ``.cpu()`` per tensor against ``PinnedSnapshot`` on a side stream | ``snapshot_gbps_cpu``, ``snapshot_gbps_pinned``, ``snapshot_enqueue_ms`` (the training thread's share) |
| a hung kernel | a spin kernel (``torch.cuda._sleep``) on the training stream, a ``StepFence`` after it | ``fence_wait_ms_while_hung`` (bounded, not done), ``fence_done_after_spin``, ``progress_moved_while_hung`` |
| gloo with CUDA tensors | two processes on the one GPU, gloo: each collective FSDP2 uses, on CUDA tensors | ``gloo_cuda_collectives`` (ok / the error, per collective) |
| bit-identity | a small model's 20 AdamW steps, twice from one seed, with ``deterministic`` on | ``deterministic_bit_identical`` |

Two NCCL ranks cannot share one GPU (NCCL refuses a duplicate device), so a multi-rank NCCL
recovery is not measured here; the gloo check says which of FSDP2's collectives a one-GPU,
multi-rank recovery over gloo could run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

STATE_BYTES = 1 << 30
TENSORS = 16


def _nccl_abort_rebuild() -> dict[str, Any]:
    import torch.distributed as dist

    from meshpact.live.recovery.device import abort_groups

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        pg = dist.new_group([0], backend="nccl")
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x, group=pg)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        abort_groups([pg], "nccl")
        abort_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        fresh = dist.new_group([0], backend="nccl")
        y = torch.full((1 << 20,), 2.0, device="cuda")
        dist.all_reduce(y, group=fresh)
        torch.cuda.synchronize()
        rebuild_ms = (time.perf_counter() - t0) * 1e3
        return {
            "nccl_abort_ms": round(abort_ms, 3),
            "nccl_rebuild_ms": round(rebuild_ms, 3),
            "nccl_rebuilt_sum_ok": bool(torch.all(y == 2.0).item()),
        }
    finally:
        dist.destroy_process_group()


def _snapshot() -> dict[str, Any]:
    from meshpact.live.recovery.device import CudaOps, PinnedSnapshot, StepFence

    n = STATE_BYTES // 4 // TENSORS
    state = [torch.randn(n, device="cuda") for _ in range(TENSORS)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host = [t.cpu() for t in state]
    cpu_s = time.perf_counter() - t0
    ops = CudaOps()
    fence, snap = StepFence(ops), PinnedSnapshot(ops)
    fence.record(0)
    snap.start(0, state, fence)  # the first start allocates the pinned buffers: not timed
    while not snap.ready():
        time.sleep(0.0005)
    fence.record(1)
    t0 = time.perf_counter()
    snap.start(1, state, fence)
    enqueue_s = time.perf_counter() - t0
    while not snap.ready():
        time.sleep(0.0001)
    pinned_s = time.perf_counter() - t0
    same = all(torch.equal(a, b) for a, b in zip(host, snap.buffers))
    gb = STATE_BYTES / 1e9
    return {
        "snapshot_gbps_cpu": round(gb / cpu_s, 2),
        "snapshot_gbps_pinned": round(gb / pinned_s, 2),
        "snapshot_enqueue_ms": round(enqueue_s * 1e3, 3),
        "snapshot_equal": same,
    }


def _hung_kernel() -> dict[str, Any]:
    from meshpact.live.recovery.device import CudaOps, DeviceProgress, StepFence

    ops = CudaOps()
    progress = DeviceProgress()
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 2.0)  # about 2 s of spinning (kHz)
    torch.cuda._sleep(cycles)
    fence = StepFence(ops)
    fence.record(0)
    progress.track(fence)
    t0 = time.perf_counter()
    done_while_hung = fence.wait(timeout_s=0.1)
    waited_ms = (time.perf_counter() - t0) * 1e3
    moved = progress.count()
    done_after = fence.wait(timeout_s=30.0)
    return {
        "fence_wait_ms_while_hung": round(waited_ms, 2),
        "fence_done_while_hung": done_while_hung,
        "fence_done_after_spin": done_after,
        "progress_moved_while_hung": moved > 0,
    }


def _gloo_rank(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: dict[str, str] = {}
    x = torch.arange(4.0, device="cuda") + rank
    for name, call in (
        ("all_reduce", lambda: dist.all_reduce(x.clone())),
        ("broadcast", lambda: dist.broadcast(x.clone(), 0)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(8, device="cuda"), x)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(2, device="cuda"), x)),
    ):
        try:
            call()
            torch.cuda.synchronize()
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the check reports what gloo says, whatever it raises
            results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def _gloo_cuda() -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = q.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
    return {"gloo_cuda_collectives": results}


def _bit_identity() -> dict[str, Any]:
    from meshpact.live.recovery.device import deterministic

    said = deterministic(True, "cuda")

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(20):
            x = torch.randn(64, 256, device="cuda", generator=g)
            loss = (model(x) - x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    a, b = run(), run()
    return {
        "deterministic_bit_identical": all(torch.equal(x, y) for x, y in zip(a, b)),
        "deterministic_said": said.said,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing measured, nothing written")
        return 0
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: the bit-identity check
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import emit

    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    for name, check in (
        ("nccl", _nccl_abort_rebuild),
        ("snapshot", _snapshot),
        ("hung", _hung_kernel),
        ("gloo", _gloo_cuda),
        ("determinism", _bit_identity),
    ):
        try:
            record.update(check())
        except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others' figures
            record[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    print("| key | value |\n|---|---|")
    for k, v in record.items():
        print(f"| {k} | {v} |")
    emit("gpu", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
