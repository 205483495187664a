"""Benchmark: one decode step per family and batch size, eager against AOTInductor-compiled.

For each model family (the spillover decoders: real vocabularies, 1/64 width, 2 layers) and
batch 1, 8 and 16: the serving loops' eager :meth:`Decoder.step`, the exportable
:class:`StepModule` run eagerly, and the same module compiled ahead of time with
``torch._inductor.aoti_compile_and_package`` and loaded as a package (with its compile
time). One thread, as the spillover hosts run. Prints a table with the load average, then
one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshpact.live.spillover.compiled import StepModule, compile_step, load_step, step_latency
from meshpact.live.spillover.decoder import FAMILIES, Decoder, scaled_spec
from _results import emit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshpact-aoti-") as tmp:
        for family in a.models.split(","):
            spec = scaled_spec(family)
            for batch in (int(b) for b in a.batches.split(",")):
                max_len = a.steps + 8
                dec = Decoder(spec, batch, max_len, seed=2)
                for s in range(batch):
                    dec.prefill(s, [1])
                slots = list(range(batch))
                decoder_s = step_latency(
                    lambda ids, pos: dec.step(slots, ids.tolist()), batch, spec.vocab_size, a.steps
                )
                module = StepModule(Decoder(spec, batch, max_len, seed=2), batch).eval()
                eager_s = step_latency(module, batch, spec.vocab_size, a.steps)
                t0 = time.perf_counter()
                package = compile_step(module, Path(tmp) / f"{family}_{batch}.pt2")
                compile_s = time.perf_counter() - t0
                aoti_s = step_latency(load_step(package), batch, spec.vocab_size, a.steps)
                row = {
                    "model": family,
                    "batch": batch,
                    "decoder_eager_ms": decoder_s * 1e3,
                    "module_eager_ms": eager_s * 1e3,
                    "aoti_ms": aoti_s * 1e3,
                    "compile_s": compile_s,
                    "speedup_vs_decoder": decoder_s / aoti_s,
                }
                rows.append(row)
                print(
                    f"{family:8s} batch {batch:2d}: Decoder.step {decoder_s * 1e3:7.2f} ms, StepModule eager "
                    f"{eager_s * 1e3:7.2f} ms, AOTI {aoti_s * 1e3:7.2f} ms ({decoder_s / aoti_s:.1f}x), "
                    f"compiled in {compile_s:.0f} s",
                    flush=True,
                )
    load = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in os.getloadavg()],
        "cores": os.cpu_count(),
    }
    print(f"load average (1/5/15 min) before {load['before']}, after {load['after']}, {load['cores']} cores")
    emit("decode_step", {"bench": "decode_step", "load_average": load, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
