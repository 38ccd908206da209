"""The CPU's arithmetic peak, measured: how many multiply-adds a second the cores issue
when every thread runs independent chains of one vector instruction, all threads at
once (a clock that drops with more busy cores is in the figure).

- ``fma_f32``: float32 FMAs (zmm where the build has AVX-512, else ymm with FMA): the
  exact mode's kernels and float32 GEMMs.
- ``dpbf16``: VDPBF16PS on zmm (two bf16 products into each float32 lane), where the CPU
  has AVX512_BF16: the fast and bfloat16 modes' kernels and oneDNN's bf16 GEMM.

A kernel's GMAC/s over these is how far it is from the machine's limit. /proc/cpuinfo's
MHz is not the clock: on a Zen 4 EPYC it said 2.6 GHz while both cores issued one zmm
VDPBF16PS a cycle at ~3.6 GHz (``docs/performance.md``).

A small C file is compiled with the system's ``cc -O3 -march=native`` (under a second)
and called through ctypes, one Python thread per torch thread (ctypes releases the GIL),
each on its own CPU.
``peak_gmacs`` returns ``{}`` where no compiler is found.

    python benchmarks/cpu_peak.py               # both peaks, on torch's threads
    python benchmarks/cpu_peak.py --threads 1   # one core's
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

#: Independent accumulators per thread: more than the instructions' latency times their
#: issue rate (VDPBF16PS: 6 cycles at one or two a cycle on the CPUs measured so far).
CHAINS = 12
SOURCE = r"""
#include <immintrin.h>
#include <time.h>
static double now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9;
}
/* Each function runs `iters` rounds of CHAINS independent accumulations with different
   inputs (equal chains would be merged by the compiler) and returns MACs a second. */
double fma_f32(long iters, int seed) {
#if defined(__AVX512F__)
  typedef __m512 V; const int lanes = 16;
#define SET1(x) _mm512_set1_ps(x)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SUM(a) _mm512_reduce_add_ps(a)
#elif defined(__FMA__)
  typedef __m256 V; const int lanes = 8;
#define SET1(x) _mm256_set1_ps(x)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SUM(a) _mm256_cvtss_f32(a)
#else
  return -1.0;
#endif
#if defined(__AVX512F__) || defined(__FMA__)
  V acc[CHAINS], x[CHAINS];
  const V w = SET1(0.999f);
  for (int i = 0; i < CHAINS; ++i) { acc[i] = SET1((float)(i + seed)); x[i] = SET1(1e-3f * i); }
  const double start = now();
  for (long n = 0; n < iters; ++n)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = FMA(acc[i], w, x[i]);
  const double seconds = now() - start;
  float sum = 0.f;
  for (int i = 0; i < CHAINS; ++i) sum += SUM(acc[i]);
  if (sum == 1234.5f) return 0.0;  /* keeps the sums alive */
  return (double)iters * CHAINS * lanes / seconds;
#endif
}
double dpbf16(long iters, int seed) {
#if defined(__AVX512BF16__)
  __m512 acc[CHAINS];
  __m512bh x[CHAINS];
  const __m512bh w = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  for (int i = 0; i < CHAINS; ++i) {
    acc[i] = _mm512_set1_ps((float)(i + seed));
    x[i] = (__m512bh)_mm512_set1_epi32(0x3a803a80 + i);
  }
  const double start = now();
  for (long n = 0; n < iters; ++n)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x[i], w);
  const double seconds = now() - start;
  float sum = 0.f;
  for (int i = 0; i < CHAINS; ++i) sum += _mm512_reduce_add_ps(acc[i]);
  if (sum == 1234.5f) return 0.0;
  return (double)iters * CHAINS * 32 / seconds;
#else
  return -1.0;
#endif
}
"""
#: Rounds per measurement: ~0.1-0.3 s at a few G instructions a second.
ITERS = 50_000_000 // CHAINS


def _library() -> ctypes.CDLL | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    directory = Path(tempfile.mkdtemp(prefix="tessera-peak-"))
    source, library = directory / "peak.c", directory / "peak.so"
    source.write_text(SOURCE.replace("CHAINS", str(CHAINS)))
    try:
        subprocess.run(
            [compiler, "-O3", "-march=native", "-shared", "-fPIC", str(source), "-o", str(library)],
            check=True,
            capture_output=True,
        )
        lib = ctypes.CDLL(str(library))
    except (subprocess.CalledProcessError, OSError):
        return None
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # the loaded library stays mapped
    for name in ("fma_f32", "dpbf16"):
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = (ctypes.c_long, ctypes.c_int)
    return lib


def _all_threads(fn, threads: int) -> float:
    """Sum of ``fn``'s MACs a second over ``threads`` threads running at once, each held
    on its own CPU of the process's (unpinned, two threads sometimes shared one core for a
    whole measurement and gave half the peak); < 0 where the build has no such
    instruction."""
    rates = [0.0] * threads
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    def run(i: int) -> None:
        if cpus:
            os.sched_setaffinity(0, {cpus[i % len(cpus)]})  # this thread only (Linux)
        rates[i] = fn(ITERS, i)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return -1.0 if min(rates) < 0 else sum(rates)


def peak_gmacs(threads: int | None = None, repeats: int = 3) -> dict[str, float]:
    """``{"fma_f32": GMAC/s, "dpbf16": GMAC/s}`` of ``threads`` threads (default: torch's),
    each the best of ``repeats``; a kind this CPU or build lacks is left out, and ``{}``
    comes back where nothing could be compiled."""
    lib = _library()
    if lib is None:
        return {}
    threads = threads or torch.get_num_threads()
    peaks = {}
    for name in ("fma_f32", "dpbf16"):
        best = max(_all_threads(getattr(lib, name), threads) for _ in range(repeats))
        if best > 0:
            peaks[name] = best / 1e9
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(),
        help="threads running at once, each on its own CPU (default: torch's, %(default)s)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="measurements, best kept")
    args = parser.parse_args()
    for name in ("threads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    found = peak_gmacs(args.threads, args.repeats)
    if not found:
        sys.exit("no C compiler found (cc or gcc): nothing measured")
    for kind, gmacs in found.items():
        print(f"{kind}: {gmacs:.1f} GMAC/s on {args.threads} thread(s)")


if __name__ == "__main__":
    main()
