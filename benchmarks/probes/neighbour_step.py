"""Probe: how much a busy neighbour process slows a step of running decodes, in process.

Keeps ``--decodes`` greedy sequences decoding, starts the neighbours (each a process
that spins ``busy`` microseconds every ``period``; default one 250 us in 3 ms and one
60 us in 0.7 ms, ~21% of a core together, in Python) stopped, then times blocks of 10
decode steps alternately quiet and beside them (SIGSTOP / SIGCONT), and prints the
medians, the neighbours' measured share of a core and what losing half of it would
cost a step (1 / (1 - share / 2): two independent threads). No peer and no JSON:
docs/performance.md draws on its output. Linux only (``/proc``).

    python benchmarks/probes/neighbour_step.py --decodes 60
    python benchmarks/probes/neighbour_step.py --neighbour 3000:250 --neighbour 700:60
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import start_decodes  # noqa: E402
from tessera.workers.config import EngineConfig  # noqa: E402
from tessera.workers.engine.engine import Engine  # noqa: E402

#: a neighbour: spin ``busy`` us every ``period`` us (argv), sleeping between
SPINNER = """
import sys, time
period, busy = float(sys.argv[1]) / 1e6, float(sys.argv[2]) / 1e6
due = time.perf_counter()
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    due += period
    wait = due - time.perf_counter()
    if wait > 0:
        time.sleep(wait)
    else:
        due = time.perf_counter()
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=60, help="running sequences")
    parser.add_argument(
        "--neighbour",
        action="append",
        help="PERIOD_US:BUSY_US, once per process (default: 3000:250 and 700:60)",
    )
    parser.add_argument("--rounds", type=int, default=8, help="blocks of 10 steps each way")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(dtype=args.dtype, num_kv_blocks=args.decodes * 40 + 400))
    start_decodes(engine, args.decodes, random.Random(1))
    neighbours = [
        subprocess.Popen([sys.executable, "-c", SPINNER, *spec.split(":")])
        for spec in args.neighbour or ["3000:250", "700:60"]
    ]
    try:
        for process in neighbours:
            process.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        steps: dict[str, list[float]] = {"quiet": [], "beside": []}
        before = [cpu_seconds(p.pid) for p in neighbours]
        beside_s = 0.0
        for round_ in range(args.rounds):
            for mode in ("quiet", "beside") if round_ % 2 == 0 else ("beside", "quiet"):
                wanted = signal.SIGCONT if mode == "beside" else signal.SIGSTOP
                for process in neighbours:
                    process.send_signal(wanted)
                time.sleep(0.05)
                block = time.perf_counter()
                for _ in range(10):
                    start = time.perf_counter()
                    engine.step()
                    steps[mode].append((time.perf_counter() - start) * 1e3)
                if mode == "beside":
                    beside_s += time.perf_counter() - block
        share = (
            sum(cpu_seconds(p.pid) - b for p, b in zip(neighbours, before, strict=True)) / beside_s
        )
    finally:
        for process in neighbours:
            process.kill()
            process.wait()
    quiet, beside = statistics.median(steps["quiet"]), statistics.median(steps["beside"])
    print(
        f"{args.decodes} decodes: quiet {quiet:.1f} ms, beside {beside:.1f} ms "
        f"({beside / quiet:.3f}x); the neighbours {share * 100:.1f}% of a core, half of it "
        f"lost: {1 / (1 - share / 2):.3f}x"
    )


if __name__ == "__main__":
    main()
