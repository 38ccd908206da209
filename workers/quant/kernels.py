"""``quant_matmul``: ``x @ dequant(W).T`` on packed GGUF weights, fp32 in and out; and
the native extension that holds it.

The extension (``csrc/gguf_mm.cpp``, the packed matmul, and ``csrc/kquant_mm.cpp``, its
K-quant form, with ``csrc/kquant_q8.cpp``, the K-quants times int8 activations;
``csrc/decode_layers.cpp``, every decoder layer of a decode step in one call;
``csrc/rows.cpp``, the sampler's row argmax, and the stack's bf16 rounding for tests) is
compiled on first use with ``torch.utils.cpp_extension.load`` into
``~/.cache/tessera/kernels/<key>`` (``XDG_CACHE_HOME`` moves it). ``<key>`` hashes the
sources, torch's version and build (environments with the same torch share one build,
imported without ninja: ``_load_built``) and the CPU flags in /proc/cpuinfo: the kernel
is built with ``-march=native``, so a machine with other flags builds its own. A lock in
that directory (``_builder_lock``, released by the system when its holder exits) lets
several processes start at once: one compiles, the others wait and load it; a build
killed half-way is started again by the next process.

Where it cannot be built (no compiler, no ninja, …) one warning is given and the torch
path runs instead: each call dequantises the weight in row chunks and multiplies. On
CUDA, ``triton_mm`` multiplies with the packed blocks in one kernel where Triton is
there (not the K-quants, which take the torch path), else the torch path runs (its
dequantised rows are bit for bit the dense weights). Both are captured in the decode
steps' CUDA graphs.
``backend="torch"`` forces that path; ``backend="native"`` raises if the kernel is
missing or ``x`` is not on the CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

from tessera.workers.quant import triton_mm
from tessera.workers.quant.blocks import PackedWeight

logger = logging.getLogger(__name__)

Backend = Literal["auto", "native", "torch"]
SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "gguf_mm.cpp",
        "decode_layers.cpp",
        "rows.cpp",
        "q4_bf16.cpp",
        "q8_bf16.cpp",
        "tiled_f32.cpp",
        "q8_screen.cpp",
        "kquant_mm.cpp",
        "kquant_q8.cpp",
    )
)
#: Included by the sources: not compiled alone, but part of the cache key.
HEADERS = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "amx_tiles.h",
        "bf16_blocks.h",
        "decode_attention.h",
        "decode_experts.h",
        "decode_layer_loop.h",
        "decode_norm_rope.h",
        "decode_shares.h",
        "decode_stack.h",
        "decode_swiglu.h",
        "decode_values.h",
        "outer16.h",
        "pieces.h",
        "rows.h",
        "side_prefetch.h",
        "tile_argmax.h",
        "tiled_f32_kernels.h",
        "tiled_layouts.h",
        "vec16.h",
    )
)
EXTENSION_NAME = "tessera_kernels"
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)
#: Rows dequantised at a time by the torch path (bounds its temporary to ~25 MB at 1536).
FALLBACK_CHUNK_ROWS = 4096
#: Rows of x from which a K-quant product dequantises the weight in chunks of rows for
#: torch's float32 GEMM instead of ``kquant_mm`` (a prompt's step): 2 cores, 2048 x 16384
#: Q4_K, 512 rows 117 ms against 190, 2048 rows 468 against 732 (~290 GFLOP/s).
K_DENSE_ROWS = 128
#: Weight rows dequantised at a time there (8 MiB of float32 at 1024 features).
K_DENSE_CHUNK_ROWS = 2048
#: What a first build takes on 2 cores, shown while compiling: ~1 min on a Xeon with
#: AVX-512, 3 min on a Zen 3 EPYC with AVX2.
COMPILE_TIME = "1-3 min"


def quant_matmul(
    x: torch.Tensor, weight: PackedWeight, backend: Backend = "auto", int8: bool = False
) -> torch.Tensor:
    """``x [..., in]`` fp32 @ ``dequant(weight).T`` -> ``[..., out]`` fp32.

    ``int8`` (a K-quant weight, the fast mode): each row of ``x`` is first quantised to
    int8 per super-block of 256 (``d = amax / 127``, ``q = rint(x * (127 / amax))`` in
    float32, ties to even) and multiplied with the weights' integers in int32
    (``csrc/kquant_q8.cpp``); the result is that of ``d * q`` times the file's weights up
    to float32 rounding, not of ``x``. Needs the native kernel (``kquant_int8_available``
    says whether its VNNI loop is built here); other weights ignore it."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(
            f"quant_matmul: x has {x.shape[-1]} features, the weight takes {weight.in_features}"
        )
    if x.dtype != torch.float32:
        raise TypeError(f"quant_matmul: x must be float32, got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"quant_matmul: x is on {x.device}, the weight on {weight.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.in_features).contiguous()
    on_cpu = x.device.type == "cpu"
    module = None if backend == "torch" or not on_cpu else native_kernels()
    if not on_cpu and backend == "native":
        raise RuntimeError(f"quant_matmul: the native GGUF kernel runs on the CPU, not {x.device}")
    if module is None and backend == "native":
        raise RuntimeError("quant_matmul: the native GGUF kernel could not be built")
    if int8 and weight.qtype.is_k:
        if module is None:
            raise RuntimeError("quant_matmul: int8 activations need the native kernels")
        y = module.kquant_q8_mm(x2, weight.qs, int(weight.qtype))
    elif module is not None and weight.qtype.is_k and x2.shape[0] >= K_DENSE_ROWS:
        y = _dense_chunks(x2, weight, module)
    elif module is not None and weight.qtype.is_k:
        y = module.kquant_mm(x2, weight.qs, int(weight.qtype))
    elif module is not None:
        y = module.gguf_mm(x2, weight.qs, weight.scales, weight.mins, int(weight.qtype))
    elif not on_cpu and backend == "auto" and not weight.qtype.is_k and triton_mm.available():
        y = triton_mm.gguf_mm(x2, weight)
    else:
        y = _torch_matmul(x2, weight)
    return y.view(*lead, weight.out_features)


def embedding(weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """``weight.embedding(ids)``, the same values, through the native ``gguf_rows`` for
    CPU tensors where it is built (the torch ops took ~0.2 ms of a 64-row decode step)."""
    if ids.device.type == "cpu" and weight.device.type == "cpu":
        module = native_kernels()
        if module is not None:
            flat = ids.reshape(-1).long()
            if weight.qtype.is_k:
                rows = module.kquant_rows(flat, weight.qs, int(weight.qtype))
            else:
                rows = module.gguf_rows(
                    flat, weight.qs, weight.scales, weight.mins, int(weight.qtype)
                )
            return rows.view(*ids.shape, weight.in_features)
    return weight.embedding(ids)


# This thread's last argmax taken by the kernel that wrote its rows (``remember_argmax``):
# (a weak reference to the rows, the indices).
_taken = threading.local()


def remember_argmax(x: torch.Tensor, indices: torch.Tensor) -> None:
    """Record ``indices``, ``x.argmax(dim=1)`` as a kernel took it while writing ``x``
    (a Q8_0 LM head, ``Q8Weight``), for ``taken_argmax``."""
    _taken.last = (weakref.ref(x), indices)


def taken_argmax(x: torch.Tensor) -> torch.Tensor | None:
    """The indices ``remember_argmax`` recorded for this very tensor on this thread (once;
    then None), else None. The caller asks right after the kernel returned ``x``, before
    anything can write into it: 64 rows of logits are 12.6 MB, whose ``argmax_rows``
    took 0.45-0.7 ms of a step."""
    taken = getattr(_taken, "last", None)
    _taken.last = None
    return taken[1] if taken is not None and taken[0]() is x else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=1)`` of a 2-D tensor, the same indices (first maximum; first NaN),
    through the native kernel for contiguous float32 CPU rows (a step's [64, 49152]
    logits: 0.45 ms, reading memory at full speed, against torch's 1.35 ms or more)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[1]:
        module = native_kernels()
        if module is not None:
            return module.argmax_rows(x.contiguous())
    return x.argmax(dim=1)


def bf16_kernel_path() -> str:
    """Which path the native bf16 x Q4 / Q8_0 kernels (``Q4Weight``, ``Q8Weight``) take
    in this process: ``"amx"`` (``csrc/amx_tiles.h``) or ``"avx512_bf16"``; ``""`` where
    they cannot run. The two sum a block's products in different orders, so a K/V block
    computed on one is not the other's (``LoadedModel.kernels``)."""
    module = native_kernels()
    if module is None or not module.q4_bf16_available():
        return ""
    return "amx" if module.amx_in_use() else "avx512_bf16"


def kquant_int8_available() -> bool:
    """Whether ``quant_matmul(..., int8=True)`` runs its AVX512-VNNI loop here (the fast
    mode's K-quant products; elsewhere a portable loop computes the same numbers slowly,
    and the fast mode is not chosen for K-quants)."""
    module = native_kernels()
    return module is not None and bool(module.kquant_q8_vnni)


def _dense_chunks(x: torch.Tensor, weight: PackedWeight, module: ModuleType) -> torch.Tensor:
    """``x @ dequant(weight).T`` for many rows of x: the weight's rows dequantised
    exactly (``kquant_rows``, gguf's values) a chunk at a time into torch's GEMM; no
    dense copy outlives the call."""
    y = x.new_empty(x.shape[0], weight.out_features)
    qtype = int(weight.qtype)
    for start in range(0, weight.out_features, K_DENSE_CHUNK_ROWS):
        stop = min(start + K_DENSE_CHUNK_ROWS, weight.out_features)
        rows = module.kquant_rows(torch.arange(start, stop), weight.qs, qtype)
        torch.mm(x, rows.t(), out=y[:, start:stop])
    return y


def _torch_matmul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    y = x.new_empty(x.shape[0], weight.out_features)
    for start in range(0, weight.out_features, FALLBACK_CHUNK_ROWS):
        stop = min(start + FALLBACK_CHUNK_ROWS, weight.out_features)
        torch.mm(x, weight.dequantize_rows(start, stop).t(), out=y[:, start:stop])
    return y


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH: put the ``ninja`` package's (a dependency)
    first. A system ninja of another version hashes the build commands differently, so
    the two rebuilt the same cache entry in turns (~75 s each): an activated environment
    found the package's, an unactivated one ``/usr/bin/ninja``."""
    try:
        import ninja
    except ImportError:
        return  # PATH's ninja if there is one; else the build fails and the torch path runs
    binary = shutil.which("ninja")
    if binary is None or Path(binary).parent.resolve() != Path(ninja.BIN_DIR).resolve():
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def native_available() -> bool:
    return native_kernels() is not None


@functools.cache
def native_kernels() -> ModuleType | None:
    """The compiled kernel module, built once per machine; ``None`` (warned) if it cannot be."""
    build_dir = kernel_cache_dir()
    built = _load_built(build_dir)
    if built is not None:
        return built
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _builder_lock(build_dir):
            built = _load_built(build_dir)  # another process built it while this one waited
            if built is not None:
                return built
            # cpp_extension's own lock, left by a build whose process died (killed, ^C):
            # cpp_extension would wait for it forever. Holding the builder lock, no live
            # process is building here.
            (build_dir / "lock").unlink(missing_ok=True)
            return _build(build_dir)
    except Exception as exc:  # no compiler, no ninja, a failed build: keep serving
        warnings.warn(
            f"tessera: native kernels could not be built ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
            "quantised matmuls fall back to dequantising in torch and decode steps run op "
            "by op (slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


@contextlib.contextmanager
def _builder_lock(build_dir: Path) -> Iterator[None]:
    """Held while this process builds (or checks for) the entry: ``flock`` on
    ``builder.lock``, which the system releases when its holder exits however it exits.
    A process that finds it held says so and waits."""
    with open(build_dir / "builder.lock", "a") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            message = (
                f"waiting for another process building tessera's native kernels in {build_dir}"
            )
            logger.info(message)
            print(message, file=sys.stderr, flush=True)
            fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _build(build_dir: Path) -> ModuleType:
    fresh = not any(build_dir.glob(f"{EXTENSION_NAME}*.so"))
    if fresh:
        message = f"compiling tessera's native kernels (once, {COMPILE_TIME}) ..."
        logger.info(message)
        print(message, file=sys.stderr, flush=True)
    start = time.perf_counter()
    from torch.utils import cpp_extension

    _ninja_on_path()
    module = cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    if fresh:
        logger.info("native kernels built in %.1f s (%s)", time.perf_counter() - start, build_dir)
    return module


def _load_built(build_dir: Path) -> ModuleType | None:
    """The entry's module imported straight from its ``.so`` where a finished build left
    one (no ``lock``: cpp_extension holds it while it builds), else None.

    Without ninja: ``cpp_extension.load`` would rerun it, and ninja rebuilds whenever the
    command line changed, which it does for every environment (the include paths name
    torch's directory). The entry is keyed by torch's version and build, not its
    directory, so every environment with the same torch shares one build (the extension
    links torch's libraries by name, which the process has loaded already)."""
    path = build_dir / f"{EXTENSION_NAME}.so"
    if not path.exists() or (build_dir / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:  # a build cut short: rebuild it
        logger.info("rebuilding %s, which did not load: %s", path, exc)
        return None
    return module


def kernel_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tessera/kernels/<hash of sources and headers, torch's version and
    build, CPU flags, flags>``."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256()
    parts = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    torch_build = f"{torch.__version__} {torch.version.git_version}".encode()
    for part in (*parts, torch_build, _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    return root / "tessera" / "kernels" / digest.hexdigest()[:16]


def _cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first CPU's model name, family and model numbers and flag set in ``cpuinfo``
    (what ``-march=native`` compiles and tunes for: an AMD EPYC of family 25 (Zen 4) and
    one of 26 (Zen 5) have the same model name)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model", "flags", "Features") and key not in found:
            found[key] = " ".join(sorted(value.split())) if key != "model name" else value.strip()
    return platform.machine() + "|" + "|".join(f"{k}={v}" for k, v in sorted(found.items()))
