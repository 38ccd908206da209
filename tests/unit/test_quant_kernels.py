"""Packed GGUF weights (Q4_0 / Q4_1 / Q8_0) and the matmul that reads them, against
gguf's own dequantisation and ``x @ dequantised.T``."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from tessera.workers.model.gguf_file import GGUFFile
from tessera.workers.model.loader import builtin_model_path
from tessera.workers.quant import PackedWeight, QuantType, int4, kernels, quant_matmul, triton_mm
from tessera.workers.quant.blocks import SPLIT_TYPES
from tessera.workers.quant.int4 import Int4Weight, Q4Weight, Q8Weight, bf16_q4_weight

ROWS = (1, 7, 16, 64)
ODD = (97, 32 * 7)  # [out, in]: neither a multiple of the kernel's 4-row tiles nor of 16 blocks


def random_packed(qtype: QuantType, shape: tuple[int, int], seed: int = 0):
    """(packed weight, gguf's dequantisation of the same bytes) from random data."""
    data = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    raw = quantize(data, qtype.value)
    return PackedWeight.from_raw(raw, qtype, shape), torch.from_numpy(dequantize(raw, qtype.value))


@pytest.fixture(scope="module")
def model_tensors() -> dict:
    return {t.name: t for t in GGUFFile(builtin_model_path()).tensors}


@pytest.fixture(scope="module")
def native():
    if kernels.native_kernels() is None:
        pytest.skip("the native GGUF kernel cannot be built here (the torch path is tested)")
    return kernels.native_kernels()


def assert_product(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """Equal to fp32 rounding: only the order of the sums differs."""
    ref = x @ dense.T
    scale = math.sqrt(dense.shape[1]) * max(1.0, dense.abs().max().item())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("qtype", SPLIT_TYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    packed, ref = random_packed(qtype, ODD)
    assert packed.shape == ODD
    assert torch.equal(packed.dequantize(), ref)
    assert torch.equal(packed.dequantize_rows(10, 50), ref[10:50])


@pytest.mark.parametrize(
    "name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"]
)
def test_dequantize_real_model_tensors_bit_for_bit(model_tensors, name):
    tensor = model_tensors[name]
    packed = PackedWeight.from_gguf(tensor)
    ref = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
    assert packed.shape == tuple(ref.shape)
    # the file's own bytes: Q4_1 layers, a Q8_0 embedding
    assert packed.qtype is (QuantType.Q8_0 if name == "token_embd.weight" else QuantType.Q4_1)
    assert torch.equal(packed.dequantize(), ref)


@pytest.mark.parametrize("qtype", SPLIT_TYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_native_matmul_odd_shape(native, qtype, rows):
    packed, dense = random_packed(qtype, ODD, seed=rows)
    x = torch.randn(rows, ODD[1], generator=torch.Generator().manual_seed(rows))
    assert_product(quant_matmul(x, packed, backend="native"), x, dense)


@pytest.mark.parametrize("qtype", SPLIT_TYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_torch_fallback_matmul(qtype, rows, monkeypatch):
    monkeypatch.setattr(kernels, "FALLBACK_CHUNK_ROWS", 40)  # several chunks and a tail
    packed, dense = random_packed(qtype, ODD, seed=rows)
    x = torch.randn(rows, ODD[1])
    assert_product(quant_matmul(x, packed, backend="torch"), x, dense)


LAYER_SHAPES = [
    ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"),  # qkv 576->960
    ("blk.1.attn_output.weight",),  # 576->576
    ("blk.2.ffn_gate.weight", "blk.2.ffn_up.weight"),  # gate_up 576->3072
    ("blk.3.ffn_down.weight",),  # 1536->576
]
HEAD = ("token_embd.weight",)  # tied head 576->49152, Q8_0
#: Every layer shape at every row count; the head (seconds at 64 rows, and no code path
#: the layers miss) at up to 16 rows.
MODEL_CASES = [(names, rows) for names in LAYER_SHAPES for rows in ROWS] + [
    (HEAD, rows) for rows in ROWS if rows <= 16
]


@pytest.mark.parametrize(("names", "rows"), MODEL_CASES)
def test_native_matmul_model_shapes(native, model_tensors, names, rows):
    packed = PackedWeight.cat([PackedWeight.from_gguf(model_tensors[n]) for n in names])
    dense = packed.dequantize()
    x = torch.randn(rows, packed.in_features)
    assert_product(quant_matmul(x, packed), x, dense)
    assert_product(quant_matmul(x[None], packed)[0], x, dense)  # leading dims kept


@pytest.mark.parametrize("qtype", SPLIT_TYPES)
def test_row_select_and_cat_on_packed_equal_dense(qtype):
    a, dense_a = random_packed(qtype, ODD, seed=1)
    b, dense_b = random_packed(qtype, (40, ODD[1]), seed=2)
    perm = torch.randperm(ODD[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.select_rows(perm).dequantize(), dense_a[perm])
    assert torch.equal(a.select_rows(slice(5, 60)).dequantize(), dense_a[5:60])
    fused = PackedWeight.cat([a, b])
    assert fused.shape == (ODD[0] + 40, ODD[1])
    assert torch.equal(fused.dequantize(), torch.cat([dense_a, dense_b]))


def test_rotary_unpermute_on_packed_rows(model_tensors):
    """The loader's q/k un-permutation is a row permutation: the same on packed rows."""
    from tessera.workers.model.gguf_model import _unpermute_rotary

    tensor = model_tensors["blk.0.attn_k.weight"]
    packed = PackedWeight.from_gguf(tensor)
    heads = 3  # SmolLM2-135M: 3 KV heads of 64
    order = _unpermute_rotary(np.arange(packed.out_features), heads)
    dense = dequantize(tensor.data, tensor.tensor_type)
    assert torch.equal(
        packed.select_rows(order).dequantize(), torch.from_numpy(_unpermute_rotary(dense, heads))
    )


def test_cat_refuses_mixed_types():
    a, _ = random_packed(QuantType.Q4_0, ODD)
    b, _ = random_packed(QuantType.Q4_1, ODD)
    with pytest.raises(ValueError, match="does not stack"):
        PackedWeight.cat([a, b])


def test_embedding_lookup(model_tensors):
    tensor = model_tensors["token_embd.weight"]
    packed = PackedWeight.from_gguf(tensor)
    ids = torch.tensor([[0, 5, 49151], [17, 17, 2]])
    rows = torch.from_numpy(dequantize(tensor.data[ids.flatten().numpy()], tensor.tensor_type))
    out = packed.embedding(ids)
    assert out.shape == (2, 3, 576) and out.dtype == torch.float32
    assert torch.equal(out.view(6, 576), rows)


@pytest.mark.parametrize("qtype", SPLIT_TYPES)
def test_native_embedding_rows_are_ggufs_dequantisation(native, qtype, monkeypatch):
    packed, dense = random_packed(qtype, ODD)
    ids = torch.tensor([96, 0, 5, 5, 41])
    assert torch.equal(
        native.gguf_rows(ids, packed.qs, packed.scales, packed.mins, qtype), dense[ids]
    )
    assert torch.equal(kernels.embedding(packed, ids.view(1, 5)), dense[ids].view(1, 5, ODD[1]))
    many = torch.arange(ODD[0]).repeat(4)  # enough rows to split between threads
    assert torch.equal(kernels.embedding(packed, many), dense[many])
    with pytest.raises(
        RuntimeError, match=r"gguf_rows: id 97 at 1 is outside the matrix's 97 rows"
    ):
        native.gguf_rows(torch.tensor([0, 97]), packed.qs, packed.scales, packed.mins, qtype)
    monkeypatch.setattr(kernels, "native_kernels", lambda: None)  # the torch path: the same
    assert torch.equal(kernels.embedding(packed, ids.view(1, 5)), dense[ids].view(1, 5, ODD[1]))


def test_validation_names_the_problem():
    packed, _ = random_packed(QuantType.Q4_1, ODD)
    with pytest.raises(ValueError, match="mins go with Q4_1 only"):
        PackedWeight(QuantType.Q4_0, packed.qs, packed.scales, packed.mins)
    with pytest.raises(ValueError, match="features"):
        quant_matmul(torch.randn(2, 64), packed)
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight.from_raw(np.zeros((1, 20), np.uint8), QuantType.Q4_1, (1, 16))
    elsewhere = packed.to("meta")  # a device without data: enough to misplace the weight
    assert elsewhere.device.type == "meta" and elsewhere.shape == packed.shape
    assert packed.to("cpu") is packed
    with pytest.raises(ValueError, match=r"^quant_matmul: x is on cpu, the weight on meta$"):
        quant_matmul(torch.randn(2, ODD[1]), elsewhere)
    x = torch.randn(2, ODD[1], device="meta")
    with pytest.raises(
        RuntimeError, match=r"^quant_matmul: the native GGUF kernel runs on the CPU, not meta$"
    ):
        quant_matmul(x, elsewhere, backend="native")


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    kernels.native_kernels.cache_clear()
    try:
        packed, dense = random_packed(QuantType.Q8_0, ODD)
        x = torch.randn(3, ODD[1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_product(quant_matmul(x, packed), x, dense)
            assert_product(quant_matmul(x, packed), x, dense)
        assert [str(w.message) for w in caught if "native kernels" in str(w.message)] == [
            "tessera: native kernels could not be built (RuntimeError: no compiler here); "
            "quantised matmuls fall back to dequantising in torch and decode steps run op "
            "by op (slower)"
        ]
        with pytest.raises(RuntimeError, match="could not be built"):
            quant_matmul(x, packed, backend="native")
    finally:
        kernels.native_kernels.cache_clear()


def test_kernel_cache_key_follows_the_cpu_and_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = kernels.kernel_cache_dir()
    assert first.parent == tmp_path / "tessera" / "kernels"
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "another cpu")
    assert kernels.kernel_cache_dir() != first


ZEN4_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni
processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni
"""


def test_cpu_identity_tells_zen4_from_zen5(tmp_path, monkeypatch):
    """Zen 4 and Zen 5 EPYCs share the model name 'AMD EPYC': the family and model
    numbers keep their kernel builds and benchmark reports apart."""
    from benchmarks.common import cpu_features

    zen4, zen5 = tmp_path / "zen4", tmp_path / "zen5"
    zen4.write_text(ZEN4_CPUINFO)
    zen5.write_text(ZEN4_CPUINFO.replace(": 25", ": 26").replace(": 17", ": 2"))
    assert kernels._cpu_flags(zen4) == (
        f"{platform.machine()}|cpu family=25|flags=avx2 avx512_bf16 avx512_vnni avx512f fpu"
        "|model=17|model name=AMD EPYC"
    )
    assert kernels._cpu_flags(zen5) != kernels._cpu_flags(zen4)
    read = kernels._cpu_flags
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: read(zen4))
    features = cpu_features()
    assert (features["model"], features["family"], features["model_number"]) == (
        "AMD EPYC",
        "25",
        "17",
    )
    assert features["avx512_bf16"] and not features["amx_tile"]


def test_a_finished_build_loads_without_the_build_tool(native, monkeypatch):
    """An entry that a finished build left (the suite's own, built by then) is imported
    from its .so: no cpp_extension, no ninja (which would rebuild it for another
    environment's torch directory), and a build still in progress (cpp_extension's lock)
    is waited for through cpp_extension."""
    from torch.utils import cpp_extension

    build_dir = kernels.kernel_cache_dir()
    assert (build_dir / f"{kernels.EXTENSION_NAME}.so").exists()

    def no_build(*args, **kwargs):
        raise AssertionError("cpp_extension.load ran for a finished build")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    module = kernels._load_built(build_dir)
    assert module is not None and module.__file__ == str(build_dir / "tessera_kernels.so")
    assert module.argmax_rows(torch.tensor([[1.0, 3.0, 2.0]])).tolist() == [1]
    lock = build_dir / "lock"
    lock.touch()
    try:
        assert kernels._load_built(build_dir) is None
    finally:
        lock.unlink()


def test_a_build_whose_process_died_is_built_again_not_waited_for(
    native, monkeypatch, tmp_path, capfd
):
    """cpp_extension's ``lock``, left by a build that was killed, made every later start
    wait forever. The builder lock dies with its holder: a later process waits only while
    the holder lives (and says so), then clears the stale lock and builds."""
    from torch.utils import cpp_extension

    build_dir = tmp_path / "entry"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what a killed build leaves
    monkeypatch.setattr(kernels, "kernel_cache_dir", lambda: build_dir)
    calls = []
    done = tmp_path / "holder-done"  # written by the holder just before it lets go

    def build(**kwargs):
        calls.append(kwargs["build_directory"])
        assert done.exists(), "built while another process held the builder lock"
        assert not (build_dir / "lock").exists(), "cpp_extension would wait on a stale lock"
        return native

    monkeypatch.setattr(cpp_extension, "load", build)
    holder = subprocess.Popen(  # another builder, alive for a moment, then gone
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(2); "
            "open(sys.argv[2], 'w').close()",
            str(build_dir / "builder.lock"),
            str(done),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n"
    assert kernels.native_kernels.__wrapped__() is native
    holder.wait(timeout=10)
    assert calls == [str(build_dir)]
    assert "waiting for another process building tessera's native kernels" in capfd.readouterr().err


def test_the_kernel_cache_key_names_torchs_build_not_its_directory(monkeypatch):
    """Two environments with the same torch (the README test's fresh venv beside the
    suite's) share one build."""
    first = kernels.kernel_cache_dir()
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert kernels.kernel_cache_dir() == first
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert kernels.kernel_cache_dir() != first


def test_the_build_runs_the_ninja_package_even_after_another_ninja_on_path(monkeypatch, tmp_path):
    """A ninja of another version earlier on PATH (a system one) hashes build commands
    differently and rebuilt the shared cache entry in turns with the package's."""
    import ninja

    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.11.1\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    kernels._ninja_on_path()
    assert Path(shutil.which("ninja")).parent.resolve() == Path(ninja.BIN_DIR).resolve()
    path = os.environ["PATH"]
    kernels._ninja_on_path()  # once is enough: PATH does not grow
    assert os.environ["PATH"] == path


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("g++") is None,
    reason="the AMX path exists on x86-64 only (and this check needs g++)",
)
def test_the_kernels_compile_for_cpus_other_than_this_one():
    """A CPU with AVX512_BF16 but no AMX (an AMD EPYC, say) builds the bf16 kernels
    without amx_tiles.h's AMX path: q4_bf16.cpp and q8_bf16.cpp must still compile (else
    such machines would fall back to torch);
    and an AVX2-only CPU builds tiled_f32.cpp with one tile at a time where AVX-512 takes
    pairs (kPairRows 0). Checked for Cooper Lake (AVX512_BF16, no AMX) and Haswell (AVX2,
    FMA, F16C) on any x86-64 host, syntax only (the whole build takes a minute), the files
    side by side (~25-35 s each on 2 cores)."""
    from torch.utils.cpp_extension import include_paths

    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").exists():
        pytest.skip("no Python headers here: the native kernels cannot be built at all")
    csrc = Path(kernels.__file__).parent / "csrc"
    command = [
        "g++",
        "-std=c++20",  # as torch's own extension builds
        "-fsyntax-only",
        *(f"-I{path}" for path in include_paths()),
        f"-I{python_include}",
    ]
    builds = [
        ("cooperlake", "q4_bf16.cpp"),
        ("cooperlake", "q8_bf16.cpp"),
        ("haswell", "tiled_f32.cpp"),
        ("haswell", "q8_screen.cpp"),  # no AVX512_VNNI: the screen's stub
    ]
    checks = [
        subprocess.Popen(
            [*command, f"-march={march}", str(csrc / name)],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        for march, name in builds
    ]
    for check in checks:
        _, stderr = check.communicate(timeout=300)
        lines = stderr.decode().splitlines()
        errors = [line for line in lines if ": error:" in line]
        assert check.returncode == 0, "\n".join(errors[:10] or lines[-10:])


def test_native_argmax_rows_equals_torch_argmax(native):
    """The sampler's row argmax: torch's index everywhere, ties to the first maximum,
    a NaN wins (its first one), rows of -inf or +inf, lengths off the 16-lane vector."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (40, 1000), generator=generator).float()  # many ties
    x[3, 500] = math.nan
    x[4, [7, 900]] = math.nan
    x[5] = -math.inf
    x[6] = math.inf
    x[7, -1] = 10.0  # the maximum in the scalar tail
    x[8, -3] = math.nan  # and a NaN there
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=1))
    logits = torch.randn(64, 49152, generator=generator)
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=1))
    odd = torch.randn(3, 17, generator=generator)
    assert torch.equal(native.argmax_rows(odd), odd.argmax(dim=1))
    assert native.argmax_rows(torch.empty(0, 5)).shape == (0,)
    with pytest.raises(RuntimeError, match="argmax_rows: x must be a contiguous float32"):
        native.argmax_rows(x.double())


def test_native_bf16_rounding_gives_torchs_bits(native):
    """The native stack's row-wise steps in bf16 round 16 values at a time
    (``vec16::store_bf16`` / ``round_bf16``, csrc/decode_layers.cpp): the same bits as
    torch's conversion for ties (to even), values that round up into the next binade or
    to inf, denormals (kept, not flushed), signed zeros and infinities, in the vector
    lanes and the scalar tail; every NaN becomes 0x7FC0 whatever its sign and payload, as
    ``c10::BFloat16`` makes it (the scalar loops' rounding; torch's vectorised conversion
    keeps the payload's top bits)."""
    bits = [
        0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000,
        0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x80000001, 0x807F8000,
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
        0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF,
    ]  # fmt: skip
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([special, torch.randn(1000, generator=generator) * 1e3, special])  # 2044
    stored, rounded = native.bf16_rounded(x)
    nan = x.isnan()
    expected = x.to(torch.bfloat16).view(torch.int16).masked_fill(nan, 0x7FC0)
    assert int(nan.sum()) == 10  # 5 NaNs in each copy of the special values
    assert torch.equal(stored.view(torch.int16), expected)
    assert torch.equal(rounded.view(torch.int32), expected.int() << 16)
    with pytest.raises(RuntimeError, match=r"bf16_rounded: x must be a contiguous float32"):
        native.bf16_rounded(x.double())


Q4_ODD = (16 * 7, 32 * 7)  # the bf16 kernel takes whole tiles of 16 outputs; 7 blocks
# and 300 rows: with 224 inputs, two passes of the bf16 kernels' rows over the tiles
# (rows_per_pass in csrc/bf16_blocks.h: 288 rows of x per pass)
BF16_ROWS = (*ROWS, 300)


@pytest.fixture(params=["amx", "avx512"])
def bf16_path(request, native):
    """Each bf16 kernel test runs on both paths of the kernels where the CPU has AMX
    (``csrc/amx_tiles.h``: every call takes it) and on the AVX512_BF16 one otherwise."""
    if request.param == "amx" and not native.amx_available():
        pytest.skip("no AMX-BF16 on this CPU (or Linux refused the tile state)")
    native.use_amx(request.param == "amx")
    yield request.param
    native.use_amx(True)


def test_the_bf16_kernels_take_the_amx_path_where_the_cpu_has_amx(native):
    """Where /proc/cpuinfo lists AMX-BF16 the build has the AMX path and takes it (a build
    or grant that silently fell back to AVX-512 would be 3.5-6x slower from 7 rows up)."""
    has_amx = {"amx_bf16", "amx_tile"} <= set(kernels._cpu_flags().split())
    assert native.amx_available() == (has_amx and native.q4_bf16_available())
    assert kernels.bf16_kernel_path() == (
        "amx" if native.amx_available() else "avx512_bf16" if native.q4_bf16_available() else ""
    )


@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q4_1])
@pytest.mark.parametrize("rows", BF16_ROWS)
def test_native_q4_bf16_matmul_keeps_the_files_weights(native, bf16_path, qtype, rows):
    """The bfloat16 mode's 4-bit kernel: bf16 x times the file's own weights (fp16 d and m,
    not rounded to bf16 as torch's int4 layout has them), summed in float32 and rounded
    once to bf16; more accurate than torch's int4 kernel on the same weights."""
    if not native.q4_bf16_available():
        pytest.skip("no AVX512_BF16 on this CPU: torch's int4 layout runs (Int4Weight)")
    packed, dense = random_packed(qtype, Q4_ODD, seed=rows)
    weight = bf16_q4_weight(packed)
    assert isinstance(weight, Q4Weight)
    x = torch.randn(rows, Q4_ODD[1], generator=torch.Generator().manual_seed(rows))
    x = x.to(torch.bfloat16)
    y = weight.matmul(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, Q4_ODD[0])
    ref = x.float() @ dense.T
    scale = math.sqrt(dense.shape[1]) * dense.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-5 * scale)
    torch_int4 = Int4Weight.from_packed(packed).matmul(x).float()
    assert (y.float() - ref).abs().mean() < (torch_int4 - ref).abs().mean()


def check_bf16_rows_product(weight, dense: torch.Tensor, rows: int):
    """``weight.matmul`` of ``rows`` random float32 rows: float32, the product of their
    bf16 rounding with ``dense`` to 2^-16 of sum |x w| (float32 sums), and the first
    and last rows' numbers the same alone. Returns (x, y)."""
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    y = weight.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (rows, dense.shape[0])
    rounded = x.to(torch.bfloat16).double()
    ref = rounded @ dense.double().T
    bound = 2**-16 * (rounded.abs() @ dense.abs().double().T) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all(), float(((y.double() - ref) / bound).max())
    assert torch.equal(y[:1], weight.matmul(x[:1]))  # a row's numbers never depend on T
    assert torch.equal(y[-1:], weight.matmul(x[-1:]))
    return x, y


@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q4_1])
@pytest.mark.parametrize("rows", BF16_ROWS)
def test_native_q4_bf16_matmul_of_float32_rows_is_the_exact_product_of_their_bf16_rounding(
    native, bf16_path, qtype, rows
):
    """The fast mode's matmul: float32 x is rounded to bf16 (nearest even) inside the
    kernel, and y is float32: the product of the rounded x with the file's weights to
    float32 rounding (no bf16 rounding of the output), whatever the number of rows."""
    if not native.q4_bf16_available():
        pytest.skip("no AVX512_BF16 on this CPU: the fast mode is not offered there")
    packed, dense = random_packed(qtype, Q4_ODD, seed=rows)
    x, y = check_bf16_rows_product(bf16_q4_weight(packed), dense, rows)
    assert not torch.equal(y, x @ dense.T)  # it did round x


@pytest.mark.parametrize("rows", [1, 64])
def test_native_q4_bf16_rounds_float32_rows_as_torch_does(native, bf16_path, rows):
    """The kernel rounds float32 x to bf16 itself (in its block-sum pass): to nearest,
    ties to even, as torch's ``.to(torch.bfloat16)``. x holds exact ties (low 16 bits
    0x8000), one below (0x7FFF) and one above (0x8001) bf16 values, both signs: the
    float32 sums of the kernel's rounding, rounded to bf16, equal the kernel's bf16-in
    product (torch's rounding of x), bit for bit."""
    if not native.q4_bf16_available():
        pytest.skip("no AVX512_BF16 on this CPU: the fast mode is not offered there")
    packed, _ = random_packed(QuantType.Q4_1, Q4_ODD, seed=3)
    weight = bf16_q4_weight(packed)
    g = torch.Generator().manual_seed(rows)
    high = torch.randn(rows, Q4_ODD[1], generator=g).to(torch.bfloat16).view(torch.int16)
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x8000], dtype=torch.int32)
    bits = (high.to(torch.int32) << 16) | low.repeat(rows, Q4_ODD[1] // 4)
    x = bits.view(torch.float32)
    assert (x.to(torch.bfloat16).float() != x).all()  # every input rounds
    assert torch.equal(weight.matmul(x).to(torch.bfloat16), weight.matmul(x.to(torch.bfloat16)))


@pytest.mark.parametrize("rows", [17, 200])
def test_native_q4_bf16_matmul_over_many_blocks(native, bf16_path, rows):
    """20 blocks of inputs: at up to 16 rows the AMX path expands a tile's blocks in
    chunks (8 at a time), above that once per pass; 17 rows end in a group of one."""
    if not native.q4_bf16_available():
        pytest.skip("no AVX512_BF16 on this CPU: the fast mode is not offered there")
    packed, dense = random_packed(QuantType.Q4_1, (16 * 5, 32 * 20), seed=rows)
    x, y = check_bf16_rows_product(bf16_q4_weight(packed), dense, rows)
    assert torch.equal(y[16:17], bf16_q4_weight(packed).matmul(x[16:17]))


@pytest.mark.parametrize("rows", (*BF16_ROWS, 8, 9))
def test_native_q8_bf16_matmul_is_the_exact_product_of_bf16_rows_with_the_files_weights(
    native, bf16_path, rows
):
    """The fast and bfloat16 modes' head: Q8_0 weights (int8 q, exact in bf16, times the
    file's fp16 d) with x rounded to bf16, summed in float32: float32 x gives the float32
    sums, bf16 x the same sums rounded once to bf16; batch-invariant. 8 rows: the most
    the kernel expands in registers (one group); 9: the fewest through its buffer."""
    if not native.q8_bf16_available():
        pytest.skip("no AVX512_BF16 on this CPU: the heads stay on the float32 kernel")
    packed, dense = random_packed(QuantType.Q8_0, Q4_ODD, seed=rows)
    weight = Q8Weight.from_packed(packed)
    x, y = check_bf16_rows_product(weight, dense, rows)
    assert torch.equal(weight.matmul(x.to(torch.bfloat16)), y.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"Q8Weight: Q4_1 \[112, 224\] needs Q8_0"):
        Q8Weight.from_packed(random_packed(QuantType.Q4_1, Q4_ODD)[0])


def test_q8_bf16_head_takes_the_argmax_of_the_logits_it_writes(native, bf16_path):
    """The fast and bfloat16 modes' head, on each of its paths: see below."""
    if not native.q8_bf16_available():
        pytest.skip("no AVX512_BF16 on this CPU: the heads stay on the float32 kernel")
    check_head_argmax(native, exact=False)


def test_q8_f32_head_takes_the_argmax_of_the_logits_it_writes(native):
    """The exact mode's head: see below."""
    if not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 on this CPU: the exact mode keeps gguf_mm's layout")
    check_head_argmax(native, exact=True)


def check_head_argmax(native, exact: bool) -> None:
    """A Q8_0 head takes each row's argmax as it writes the logits
    (``csrc/tile_argmax.h``): torch's argmax of those logits on every row count and pass,
    ties to the first maximum across lanes, tiles and threads' ranges, a row's first NaN
    (also one in the last range), a row of -inf; ``taken_argmax`` of the logits gives it
    once, and only for them. ``Q8Weight.argmax`` (the kernel's argmax without the logits
    written; with a NaN it writes them and reads that row again) gives the same indices,
    for the exact head through each of its loops above 12 rows (``int4.TILED_LOOPS``)."""
    assert torch.get_num_threads() >= 2  # so that the 7 tiles split into ranges
    name = "q8_f32_mm" if exact else "q8_bf16_mm"
    plain, with_argmax = getattr(native, name), getattr(native, f"{name}_argmax")
    only = getattr(native, name.replace("_mm", "_argmax"))
    loops = int4.TILED_LOOPS if exact else (None,)
    packed, _ = random_packed(QuantType.Q8_0, Q4_ODD)
    qs, scales = packed.qs.clone(), packed.scales.abs()  # every d > 0
    # outputs 17, 50 and 100 (tiles 1, 3 and 6) the same, and the largest for positive x
    for out in (17, 50, 100):
        qs[out], scales[out] = 127, 2.0
    qs[90] = 0  # output 90 (tile 5, the last range) all zero: 0 * inf is a NaN ...
    qs[:, 5] = 1  # ... but at input 5, where every weight is positive
    # an input where no output before 90 has a zero weight: inf there makes NaN at 90 only
    k = next(k for k in range(6, Q4_ODD[1]) if bool((qs[:90, k] != 0).all()))
    weight = Q8Weight.from_packed(PackedWeight(QuantType.Q8_0, qs, scales, None), exact)
    for rows in (*BF16_ROWS, 600, 1200):  # 600: two of q8_f32_mm's passes; 1200: AMX's
        x = torch.randn(rows, Q4_ODD[1], generator=torch.Generator().manual_seed(rows))
        x[0] = x[0].abs()  # the tie at 17, 50, 100 is the maximum: 17
        if rows > 4:
            x[1] = 0.0
            x[1, k] = math.inf  # +-inf everywhere but NaN at 90 (and later): 90
            x[2] = 0.0  # every logit 0: index 0
            x[3] = 0.0
            x[3, 5] = -math.inf  # every logit -inf: index 0
            x[4] = 1e-30  # tiny, ties again
        y, ids = with_argmax(x, weight.qs, weight.d)
        torch.testing.assert_close(y, plain(x, weight.qs, weight.d), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(ids, y.argmax(dim=1))
        assert ids[0] == 17
        if rows > 4:
            assert ids[1:4].tolist() == [90, 0, 0] and bool((y[3] == -math.inf).all())
        logits = weight.matmul(x)
        assert torch.equal(kernels.taken_argmax(logits), ids)
        assert kernels.taken_argmax(logits) is None  # once
        weight.matmul(x)
        assert kernels.taken_argmax(logits) is None  # another tensor's
        try:
            for loop in loops:
                if loop is not None:
                    native.use_tiled_loop(loop)
                assert torch.equal(weight.argmax(x), ids), (rows, loop)
                if rows > 4:  # no NaN: the logits are never written
                    assert torch.equal(weight.argmax(x[5:]), ids[5:]), (rows, loop)
        finally:
            if exact:
                native.use_tiled_loop(int4.tiled_loop())
    assert with_argmax(x[:0], weight.qs, weight.d)[1].shape == (0,)
    assert only(x[:0], weight.qs, weight.d).shape == (0,)
    with pytest.raises(RuntimeError, match=rf"{name}_argmax: x must be a float32 \[T, K\]"):
        with_argmax(x.to(torch.bfloat16), weight.qs, weight.d)
    with pytest.raises(RuntimeError, match=rf"{only.__name__}: x must be a float32 \[T, K\]"):
        only(x.to(torch.bfloat16), weight.qs, weight.d)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_the_int8_screen_gives_the_heads_own_argmax(native, exact):
    """``q8_screen_argmax`` (``csrc/q8_screen.cpp``: an int8 screen with a bound on its
    error, then the head's own sums for the tiles that can hold the maximum) gives each row
    the index the head's argmax gives (``q8_f32_argmax`` / ``q8_bf16_argmax``, tested above
    against torch's argmax of the logits), and ``Q8Weight.argmax`` takes it where the build
    has it. Rows: random ones at every row count the screen groups differently (1, 8, 9,
    64, 100); one where the screen's own numbers put the wrong column first (outputs 3 and
    20: without the bound the screen keeps only 20's tile); ties between equal outputs,
    across tiles and within one; rows of zeros, of tiny blocks (screened as zeros), with
    denormals beside normal values, too large to bound (1e25), with a NaN or an infinity
    (the head's whole argmax: its first NaN)."""
    if not native.q8_screen_available():
        pytest.skip("no AVX512_VNNI on this CPU: the heads take their own argmax")
    if not (native.tiled_f32_available() if exact else native.q8_bf16_available()):
        pytest.skip("this CPU has no kernel for this head")
    packed, _ = random_packed(QuantType.Q8_0, (16 * 9, 32 * 3))
    qs, scales = packed.qs.clone(), packed.scales.clone()
    qs[[17, 40, 41, 100]] = qs[5].clone()  # outputs 5, 17, 40, 41, 100 equal (tiles 0, 1, 2, 6)
    scales[[17, 40, 41, 100]] = scales[5].clone()
    # outputs 3 (tile 0) and 20 (tile 1): with x = (1, 0.005, 0, ...) output 3 is 1.00021,
    # output 20 0.99809; the screen rounds 0.005 to 1/127 and makes 20 the larger (1.00174)
    qs[:, :2], qs[3], qs[20] = 0, 0, 0  # (every other output 0 there)
    qs[3, 0], qs[20, 0], qs[20, 1] = 100, 99, 127
    scales[3], scales[20] = 0.01, 0.01002
    scales[3:4, 1:], scales[20:21, 1:] = 0.0, 0.0
    qs[60, 2::3] = -128  # the int8 extreme (unsigned 0 once biased by 128)
    weight = Q8Weight.from_packed(PackedWeight(QuantType.Q8_0, qs, scales, None), exact)
    assert weight.screen is not None and weight.screen.shape == (9, 3)
    full = native.q8_f32_argmax if exact else native.q8_bf16_argmax
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(100, 96, generator=generator)
    x[0] = 0.0
    x[0, :2] = torch.tensor([1.0, 0.005])  # output 3, not 20
    x[1] = 0.0  # every logit 0: index 0
    x[2] = 1e-25  # every block tiny: screened as zeros, all tiles kept
    x[3, :32] = 1e-40  # a block of denormals (flushed by the fast head), the rest normal
    x[4, 7] = 1e-40  # one denormal among normal values
    x[5] = x[5] * 1e25  # too large to bound: the head's whole argmax
    x[6, 50] = math.nan
    x[7, 10] = math.inf
    x[8] = -x[8].abs()  # mostly negative logits
    x[9] = packed.dequantize()[5] * 3  # output 5's own weights: its group ties at the top
    try:
        if not exact:
            native.use_amx(False)  # the screen follows the AVX512_BF16 path's sums
        ids = full(x, weight.qs, weight.d)
        assert ids[0] == 3
        assert ids[9] == 5
        for rows in (1, 8, 9, 64, 100):
            screened = native.q8_screen_argmax(x[:rows], weight.qs, weight.d, weight.screen, exact)
            assert torch.equal(screened, ids[:rows]), rows
            assert torch.equal(weight.argmax(x[:rows]), ids[:rows]), rows
        for row in range(len(x)):  # a row's answer never depends on the others
            one = x[row : row + 1]
            alone = native.q8_screen_argmax(one, weight.qs, weight.d, weight.screen, exact)
            assert alone.tolist() == [ids[row].item()], row
    finally:
        native.use_amx(True)
    # 4,096 inputs: rounding bound past its 1e-4 floor (csrc/q8_screen.cpp, screen_eps)
    wide_packed, _ = random_packed(QuantType.Q8_0, (16 * 5, 32 * 128), seed=1)
    wide = Q8Weight.from_packed(wide_packed, exact)
    wide_x = torch.randn(40, 32 * 128, generator=generator)
    wide_x[1] = wide_packed.dequantize()[7] * 2  # output 7's own weights: near the top
    try:
        if not exact:
            native.use_amx(False)
        ids = full(wide_x, wide.qs, wide.d)
        screened = native.q8_screen_argmax(wide_x, wide.qs, wide.d, wide.screen, exact)
        assert torch.equal(screened, ids)
    finally:
        native.use_amx(True)
    # an infinite scale: no screen (the head's own argmax, its first NaN)
    scales[70, 1] = math.inf
    broken = Q8Weight.from_packed(PackedWeight(QuantType.Q8_0, qs, scales, None), exact)
    assert broken.screen is None
    with pytest.raises(RuntimeError, match="q8_screen_l1: d holds an infinite or NaN scale"):
        native.q8_screen_l1(broken.qs, broken.d)
    assert native.q8_screen_argmax(x[:0], weight.qs, weight.d, weight.screen, exact).shape == (0,)
    with pytest.raises(RuntimeError, match=r"q8_screen_argmax: l1 must be q8_screen_l1\(qs, d\)"):
        native.q8_screen_argmax(x, weight.qs, weight.d, weight.screen[1:], exact)
    with pytest.raises(RuntimeError, match=r"q8_screen_argmax: x must be a float32 \[T, K\]"):
        native.q8_screen_argmax(x.double(), weight.qs, weight.d, weight.screen, exact)


#: csrc/tiled_f32.cpp holds kRowsF32 rows at once, 12 (AVX-512) or 3 (AVX2): 2-4 rows take
#: one micro-kernel on one and 4 the loop ``tiled_loop`` chose on the other; 13 rows that
#: loop under AVX-512 (12 rows and a 1-row remainder; in pairs of tiles, 6 + 6 + 1 and the
#: odd last tile alone); 600 rows two passes of 300 (a pass holds at most ~512 KB of x)
F32_ROWS = (*ROWS, 2, 3, 4, 9, 13, 600)


def check_f32_rows_product(weight, dense: torch.Tensor, rows: int):
    """``weight.matmul`` of ``rows`` random float32 rows: float32, equal to x @ dense.T to
    float32 rounding, and the first and last rows' numbers the same alone. Returns
    (x, y)."""
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    y = weight.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (rows, dense.shape[0])
    assert_product(y, x, dense)
    assert torch.equal(y[:1], weight.matmul(x[:1]))  # a row's numbers never depend on T
    assert torch.equal(y[-1:], weight.matmul(x[-1:]))
    return x, y


@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q4_1])
@pytest.mark.parametrize("rows", F32_ROWS)
def test_native_q4_f32_matmul_is_the_float32_product_with_the_files_weights(native, qtype, rows):
    """The exact mode's Q4 kernel: each weight dequantised as gguf does (bit for bit, as
    ``Q4Weight.dequantize`` shows), float32 products and sums, so equal to x @ dense.T to
    float32 rounding; a row's numbers are the same alone."""
    if not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 on this CPU: the exact mode keeps gguf_mm's layout")
    packed, dense = random_packed(qtype, Q4_ODD, seed=rows)
    weight = Q4Weight.from_packed(packed, exact=True)
    assert torch.equal(weight.dequantize(), dense)
    assert torch.equal(weight.dense(), dense.T)  # the kernel's dequantisation, for a GEMM
    x, _ = check_f32_rows_product(weight, dense, rows)
    with pytest.raises(RuntimeError, match=r"q4_f32_mm: x must be a float32 \[T, K\] CPU tensor"):
        weight.matmul(x.to(torch.bfloat16))


@pytest.mark.parametrize("rows", F32_ROWS)
def test_native_q8_f32_matmul_is_the_float32_product_with_the_files_weights(native, rows):
    """The exact mode's tied head: Q8_0 weights (d * q, as gguf) times float32 x in
    float32, equal to x @ dense.T to float32 rounding; batch-invariant."""
    if not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 on this CPU: the exact mode keeps gguf_mm's layout")
    packed, dense = random_packed(QuantType.Q8_0, Q4_ODD, seed=rows)
    check_f32_rows_product(Q8Weight.from_packed(packed, exact=True), dense, rows)


def test_tiled_kernels_name_what_is_wrong(native):
    """The layout checks every tiled kernel shares (``csrc/tiled_layouts.h``), each message
    naming the kernel, the tensor and what it needed."""
    packed, _ = random_packed(QuantType.Q4_1, Q4_ODD)
    q4 = Q4Weight.from_packed(packed, exact=True) if native.tiled_f32_available() else None
    if q4 is None:
        pytest.skip("no AVX-512 or AVX2 on this CPU")
    q8 = Q8Weight.from_packed(random_packed(QuantType.Q8_0, Q4_ODD)[0], exact=True)
    x = torch.randn(2, Q4_ODD[1])
    kernels = [("q4_f32_mm", native.q4_f32_mm)]
    if native.q4_bf16_available():
        kernels.append(("q4_bf16_mm", native.q4_bf16_mm))
    for name, kernel in kernels:
        with pytest.raises(
            RuntimeError, match=rf"{name}: x has 100 features, the weight takes 224"
        ):
            kernel(torch.randn(2, 100), q4.nibbles, q4.d, q4.m, int(q4.qtype))
        with pytest.raises(RuntimeError, match=rf"{name}: qtype 8 is not Q4_0/Q4_1"):
            kernel(x, q4.nibbles, q4.d, q4.m, 8)
        with pytest.raises(RuntimeError, match=rf"{name}: mins go with Q4_1 only"):
            kernel(x, q4.nibbles, q4.d, None, int(q4.qtype))
        with pytest.raises(
            RuntimeError, match=rf"{name}: nibbles must be contiguous uint8 with 12544 bytes"
        ):
            kernel(x, q4.nibbles[:-1], q4.d, q4.m, int(q4.qtype))
    with pytest.raises(RuntimeError, match=r"q8_f32_mm: qs must be contiguous int8 with 25088"):
        native.q8_f32_mm(x, q8.qs[:-1], q8.d)
    with pytest.raises(RuntimeError, match=r"q8_f32_mm: d must be a contiguous fp16 \[N / 16"):
        native.q8_f32_mm(x, q8.qs, q8.d.float())


#: The model's Q4 layer shapes at every row count; its tied Q8_0 head up to 16 rows.
F32_MODEL_CASES = [(n, r) for n in LAYER_SHAPES for r in ROWS] + [
    (HEAD, rows) for rows in ROWS if rows <= 16
]


@pytest.mark.parametrize(("names", "rows"), F32_MODEL_CASES)
def test_native_tiled_f32_matmul_model_shapes(native, model_tensors, names, rows):
    if not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 on this CPU: the exact mode keeps gguf_mm's layout")
    packed = PackedWeight.cat([PackedWeight.from_gguf(model_tensors[n]) for n in names])
    tiled = Q8Weight if packed.qtype is QuantType.Q8_0 else Q4Weight
    weight = tiled.from_packed(packed, exact=True)
    x = torch.randn(rows, packed.in_features)
    assert_product(weight.matmul(x), x, packed.dequantize())


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_tiled_f32_results_do_not_depend_on_how_the_threads_split_the_tiles(
    native, model_tensors, rows
):
    """csrc/pieces.h: with two threads the tiles go in pieces claimed as threads come free
    (300 rows of the down projection are several passes, each in pieces); with one thread
    one call takes them all. Every output, and the head's argmax, bit for bit."""
    if not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 on this CPU: the exact mode keeps gguf_mm's layout")
    down = Q4Weight.from_packed(
        PackedWeight.from_gguf(model_tensors["blk.0.ffn_down.weight"]), exact=True
    )
    head = Q8Weight.from_packed(
        PackedWeight.from_gguf(model_tensors["token_embd.weight"]), exact=True
    )
    x = torch.randn(rows, down.in_features)
    h = torch.randn(rows, head.in_features)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            logits, ids = native.q8_f32_mm_argmax(h, head.qs, head.d)
            results.append((down.matmul(x), logits, ids))
    finally:
        torch.set_num_threads(threads)
    (y1, logits1, ids1), (y2, logits2, ids2) = results
    assert torch.equal(y1, y2) and torch.equal(logits1, logits2)
    assert ids1.tolist() == ids2.tolist() == logits1.argmax(dim=1).tolist()


def check_probe_choice(monkeypatch, probe, use, in_use, timings: list[float], chosen, other):
    """A load-time probe of ``int4`` (``onednn_gemm``, ``tiled_loop``: each times the ways
    of one product through ``_best_times`` and sets the native switch ``use`` to the
    fastest), given ``timings`` in the order it takes them: it returns ``chosen``, the
    switch (read by ``in_use``) says so, whatever it said before (``other``); then the
    probe is run again for real, so the process keeps this CPU's choice."""
    times = iter(timings)
    monkeypatch.setattr(int4, "_best_times", lambda *fns, repeats=5: [next(times) for _ in fns])
    probe.cache_clear()
    try:
        use(other)
        assert probe() == chosen
        assert in_use() == chosen
    finally:
        probe.cache_clear()
        monkeypatch.undo()
        use(probe())


@pytest.mark.parametrize("rows", [13, 24, 64, 600])
def test_every_tiled_loop_gives_the_same_bits(native, rows):
    """csrc/tiled_f32.cpp takes more than 12 rows (3 under AVX2) by whichever loop
    ``tiled_loop`` timed fastest on this CPU (each tile dequantised in registers for every
    micro-kernel's rows, into a buffer
    one tile at a time, or two at a time): every output of a Q4_1 and a Q8_0 matrix of an
    odd tile count (7 tiles: three pairs and a tile alone), and the head's argmax, bit for
    bit every way, and each row as it is alone (a row's sums never depend on the rows
    beside it)."""
    if not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 on this CPU: the exact mode keeps gguf_mm's layout")
    q4 = Q4Weight.from_packed(random_packed(QuantType.Q4_1, Q4_ODD, seed=rows)[0], exact=True)
    q8 = Q8Weight.from_packed(random_packed(QuantType.Q8_0, Q4_ODD, seed=rows)[0], exact=True)
    x = torch.randn(rows, Q4_ODD[1], generator=torch.Generator().manual_seed(rows))
    results = {}
    try:
        for loop in int4.TILED_LOOPS:
            if native.use_tiled_loop(loop) != loop:
                assert (loop, native.tiled_loop_in_use()) == ("pairs", "buffered")  # AVX2
                continue
            assert native.tiled_loop_in_use() == loop
            results[loop] = (q4.matmul(x), *native.q8_f32_mm_argmax(x, q8.qs, q8.d))
    finally:
        native.use_tiled_loop(int4.tiled_loop())
    alone = [q4.matmul(x[[r]]) for r in (0, rows - 1)]
    reference = results["registers"]
    for loop, outputs in results.items():
        for got, expected in zip(outputs, reference, strict=True):
            assert torch.equal(got, expected), loop
    assert torch.equal(reference[0][[0, rows - 1]], torch.cat(alone))
    with pytest.raises(RuntimeError, match="use_tiled_loop: the loops are registers, buffered"):
        native.use_tiled_loop("tiles")


def test_probe_timings_are_taken_in_turn(monkeypatch):
    """``_best_times``: one warm-up run of each way, then one run of each in turn, each
    way's best run returned (a clock that only the runs move, so the times are exact)."""
    now, calls = [0.0], []

    def way(name: str, costs: list[float]):
        runs = iter(costs)

        def run() -> None:
            calls.append(name)
            now[0] += next(runs)

        return run

    monkeypatch.setattr(int4.time, "perf_counter", lambda: now[0])
    ways = way("a", [9.0, 3.0, 1.0, 3.0]), way("b", [9.0, 2.0, 4.0, 2.0])
    assert int4._best_times(*ways, repeats=3) == [1.0, 2.0]
    assert calls == ["a", "b"] * 4


@pytest.mark.parametrize("fastest", ["registers", "buffered", "pairs"])
def test_tiled_loop_takes_the_fastest_loop_of_this_cpu(native, monkeypatch, fastest):
    """The exact mode's loop above 12 rows is the one that ran the probe products
    (``LOOP_PROBE_ROWS`` rows of ``LOOP_PROBE_SHAPE``; the timings are given) fastest in
    all; the kernel then takes it."""
    if not native.tiled_f32_available() or native.use_tiled_loop("pairs") != "pairs":
        pytest.skip("this build has no pair loop (AVX2: registers or one buffered tile)")
    loops = int4.TILED_LOOPS
    # at each row count, each loop in TILED_LOOPS' order: the fastest 1.0, the others 2.0
    timings = [1.0 if loop == fastest else 2.0 for _ in int4.LOOP_PROBE_ROWS for loop in loops]
    other = next(loop for loop in loops if loop != fastest)
    check_probe_choice(
        monkeypatch, int4.tiled_loop, native.use_tiled_loop, native.tiled_loop_in_use, timings,
        fastest, other,
    )  # fmt: skip


def test_bf16_q4_weight_falls_back_to_torch_int4_then_dense(monkeypatch):
    """Without the native kernel torch's int4 layout; neither takes Q8_0 or outputs that
    are not whole tiles of 16 (the model keeps those dense)."""
    packed, _ = random_packed(QuantType.Q4_1, ODD)  # 97 outputs
    assert bf16_q4_weight(packed) is None
    assert bf16_q4_weight(random_packed(QuantType.Q8_0, Q4_ODD)[0]) is None
    with pytest.raises(ValueError, match=r"Q4Weight: Q4_1 \[97, 224\] needs a 4-bit type"):
        Q4Weight.from_packed(packed)
    monkeypatch.setattr(int4, "native_kernels", lambda: None)
    packed, dense = random_packed(QuantType.Q4_1, Q4_ODD)
    weight = bf16_q4_weight(packed)
    assert isinstance(weight, Int4Weight)
    x = torch.randn(5, Q4_ODD[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = x.float() @ dense.T
    bound = 2**-7 * (x.float().abs() @ dense.abs().T)  # bf16 d, m and output rounding
    assert ((weight.matmul(x).float() - ref).abs() <= bound).all()


def measured_limit(monkeypatch, row_limit, probe_rows, dense_wins_from: int | None) -> int:
    """``row_limit(32, 64)`` (``int4_row_limit``, ``exact_row_limit``) with the timings given:
    the kernel 1.0 at every probed row count, the GEMM 0.5 from ``dense_wins_from`` rows
    (never if None), else 2.0."""
    int4.onednn_gemm()  # the exact mode's GEMM, chosen (and timed) before the timings given
    int4.tiled_loop()  # and its tiled kernel's loop
    calls = iter(range(2 * len(probe_rows)))  # the kernel, then the GEMM, at each count

    def timed(*fns, repeats: int = 5) -> list[float]:
        times = []
        for _ in fns:
            index = next(calls)
            rows = probe_rows[index // 2]
            if index % 2 == 0:
                times.append(1.0)
            else:
                wins = dense_wins_from is not None and rows >= dense_wins_from
                times.append(0.5 if wins else 2.0)
        return times

    monkeypatch.setattr(int4, "_best_times", timed)
    row_limit.cache_clear()
    try:
        return row_limit(32, 64)
    finally:
        row_limit.cache_clear()


@pytest.mark.parametrize(("dense_wins_from", "limit"), [(None, int4.ALL_ROWS), (16, 8), (1, 0)])
def test_int4_row_limit_and_the_dense_copy_follow_the_measured_crossover(
    monkeypatch, dense_wins_from, limit
):
    """The bfloat16 mode without the native kernel: torch's int4 up to the last probed row
    count where it beat the dense bf16 GEMM, every count where it beat it at all of them
    (a CPU without native bf16: no dense copy kept), none where it never did. The
    timings are given; the rows' products are torch's int4 kernel's either way."""
    from torch import nn

    from tessera.workers.model import llama

    assert (
        measured_limit(monkeypatch, int4.int4_row_limit, int4.PROBE_ROWS, dense_wins_from) == limit
    )
    monkeypatch.setattr(int4, "native_kernels", lambda: None)  # torch's int4 layout
    monkeypatch.setattr(llama, "int4_row_limit", lambda out_features, in_features: limit)
    packed, _ = random_packed(QuantType.Q4_0, Q4_ODD)
    linear = llama.Linear(packed.in_features, packed.out_features, bias=False)
    linear.weight = nn.Parameter(linear.weight.to(torch.bfloat16), requires_grad=False)
    linear.load_weight([packed], "w")
    assert isinstance(linear.int4, Int4Weight) and linear.int4_rows == limit
    expected_shape = (0,) if limit == int4.ALL_ROWS else (packed.in_features, packed.out_features)
    assert tuple(linear.weight.shape) == expected_shape
    x = torch.randn(200, packed.in_features).to(torch.bfloat16)  # past every probed count
    if limit == int4.ALL_ROWS:
        assert torch.equal(linear(x), linear.int4.matmul(x))


@pytest.mark.parametrize("onednn", [False, True], ids=["mkl", "onednn"])
@pytest.mark.parametrize(
    ("dense_wins_from", "limit"), [(None, int4.ALL_ROWS), (512, 256), (128, int4.EXACT_MIN_ROWS)]
)
def test_exact_row_limit_sends_larger_products_to_a_dense_gemm_of_the_same_weights(
    native, monkeypatch, dense_wins_from, limit, onednn
):
    """The exact mode's Q4 matrices: the tiled kernel up to the last probed row count where
    it beat dequantising for the float32 GEMM (never below ``EXACT_MIN_ROWS``, a decode
    step's rows), every count where it always did. The timings are given; past the
    limit a product is that GEMM's of the file's weights (``dense_f32_mm``: MKL's, or
    oneDNN's), bit for bit, and up to it the kernel's."""
    if not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 on this CPU: the exact mode keeps gguf_mm's layout")
    if onednn and not native.onednn_gemm_available():
        pytest.skip("this torch has no oneDNN float32 linear")
    from tessera.workers.model import llama

    probes = int4.EXACT_PROBE_ROWS
    assert measured_limit(monkeypatch, int4.exact_row_limit, probes, dense_wins_from) == limit
    monkeypatch.setattr(llama, "exact_row_limit", lambda out_features, in_features: 4)
    packed, dense = random_packed(QuantType.Q4_1, Q4_ODD)
    linear = llama.Linear(packed.in_features, packed.out_features, bias=True)
    linear.bias.copy_(torch.randn(packed.out_features))
    linear.load_weight([packed], "w")
    assert isinstance(linear.int4, Q4Weight) and linear.int4.exact and linear.int4_rows == 4
    assert linear.weight.numel() == 0  # no dense copy kept
    x = torch.randn(9, packed.in_features)
    assert torch.equal(linear(x[:4]), linear.int4.matmul(x[:4]).add_(linear.bias))
    try:
        assert native.use_onednn_gemm(onednn) == onednn
        gemm = native.dense_f32_mm(x, dense.T.contiguous(), linear.bias)
        assert torch.equal(linear(x), gemm)
    finally:
        native.use_onednn_gemm(int4.onednn_gemm())
    if not onednn:  # MKL's: torch's own GEMM
        assert torch.equal(gemm, torch.addmm(linear.bias, x, dense.T.contiguous()))


def test_dense_f32_mm_is_the_float32_product_through_either_gemm(native):
    """``dense_f32_mm``: ``x @ w + bias`` to float32 rounding through oneDNN and MKL alike
    (MKL's bit for bit ``torch.addmm``), with a clear error for shapes that do not chain."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(130, 96, generator=generator)
    w = torch.randn(96, 48, generator=generator)
    bias = torch.randn(48, generator=generator)
    ref = x.double() @ w.double() + bias.double()
    bound = 1e-5 * (x.abs().double() @ w.abs().double() + bias.abs().double())
    try:
        for onednn in (False, True):
            if native.use_onednn_gemm(onednn) != onednn:
                assert onednn and not native.onednn_gemm_available()
                continue
            y = native.dense_f32_mm(x, w, bias)
            assert y.dtype == torch.float32 and y.shape == (130, 48)
            assert ((y.double() - ref).abs() <= bound).all()
            assert torch.equal(native.dense_f32_mm(x, w), native.dense_f32_mm(x, w, None))
            if not onednn:
                assert torch.equal(y, torch.addmm(bias, x, w))
    finally:
        native.use_onednn_gemm(int4.onednn_gemm())
    expected = "dense_f32_mm: x [T, K] and w [K, N] expected, got [130, 96] and [48, 96]"
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        native.dense_f32_mm(x, w.T)
    expected = "dense_f32_mm: x, w and bias must be float32 CPU tensors, got BFloat16, Float"
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        native.dense_f32_mm(x.bfloat16(), w)


@pytest.mark.parametrize(("mkl_s", "onednn_s", "chosen"), [(2.0, 1.0, True), (1.0, 2.0, False)])
def test_onednn_gemm_takes_the_faster_gemm_of_this_cpu(
    native, monkeypatch, mkl_s, onednn_s, chosen
):
    """The exact mode's GEMM of many rows is whichever of MKL's and oneDNN's ran the probe
    product faster (the timings are given), and ``dense_f32_mm`` then takes it."""
    if not native.onednn_gemm_available():
        pytest.skip("this torch has no oneDNN float32 linear")
    timings = [mkl_s, onednn_s]  # MKL first, then oneDNN
    check_probe_choice(
        monkeypatch, int4.onednn_gemm, native.use_onednn_gemm, native.onednn_gemm_in_use,
        timings, chosen, not chosen,
    )  # fmt: skip


def test_the_cuda_kernels_tilings_by_row_count_and_their_checks():
    """Which Triton kernel ``gguf_mm`` takes per row count (no GPU needed to choose), and
    the limits a tiling given to it is held to before any launch."""
    assert [triton_mm.tiling(rows).kernel for rows in (0, 1, 4, 5, 64, 4096)] == [
        "gemv", "gemv", "gemv", "dot", "dot", "dot",
    ]  # fmt: skip
    cases = [
        ({"kernel": "mv"}, "kernel: must be 'dot' or 'gemv', got 'mv'"),
        ({"kb": 3}, "kb: must be a power of two >= 1, got 3"),
        ({"tile_n": 8}, "tile_n: must be a power of two >= 16, got 8"),
        ({"warps": 0}, "warps: must be a power of two >= 1, got 0"),
        ({"split": 0}, "split: must be >= 1, got 0"),
        ({"stages": 0}, "stages: must be >= 1, got 0"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            dataclasses.replace(triton_mm.DOT, **change)
    assert dataclasses.replace(triton_mm.GEMV, tile_n=8).tile_n == 8  # one row: any power


def prefetches_by_function(library: str) -> dict[str, dict[str, int]]:
    """Each function of the built library (demangled name) -> its count of each x86
    prefetch instruction, from ``objdump``'s disassembly."""
    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", library],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found: dict[str, dict[str, int]] = {}
    name = ""
    for line in listing.splitlines():
        start = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if start:
            name = start.group(1)
            continue
        hint = re.search(r"\s(prefetcht[012]|prefetchnta)\s", line)
        if hint:
            counts = found.setdefault(name, {})
            counts[hint.group(1)] = counts.get(hint.group(1), 0) + 1
    return found


def test_the_built_kernels_keep_their_prefetches(native):
    """The prefetches are hints that never change a number, so no product test can see
    them go. GCC 12 once compiled every prefetch out of the kernels' next-tile helper
    (``tiled::NextTile``, tiled_layouts.h) without a word; a decode step's products lost
    ~10%. So the library as built here is read back: each kernel's tile loop asks for the
    next tile (``prefetcht0``), and the ones a share of a decode step runs also drain the
    next layer's K/V queue (``prefetcht1``, side_prefetch.h)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the check reads x86 instructions; this is {platform.machine()}")
    if shutil.which("objdump") is None:
        pytest.skip("no objdump (binutils) to read the built library with")
    found = prefetches_by_function(native.__file__)
    # (kernel, a pattern of its functions' names, the hints it must keep). Attention is
    # attend_heads where vec16.h has AVX-512 or AVX2 (as the exact kernels), else
    # attend_task, inlined into attend_all.
    vec = native.tiled_f32_available()
    attention = r"attend_heads<" if vec else r"attend_all<"
    wanted = [("decode attention", attention, ("prefetcht0",))]
    if native.q4_bf16_available():
        wanted.append(("bf16 x Q4", r"q4_rows<float>\(", ("prefetcht0", "prefetcht1")))
    if native.q8_bf16_available():
        wanted.append(("bf16 x Q8_0", r"q8_rows<float>\(", ("prefetcht0",)))
    if vec:
        both = ("prefetcht0", "prefetcht1")
        wanted.append(("float32 x Q4", r"tiled_rows<tessera::q4_f32_mm\(", both))
        wanted.append(("float32 x Q8_0", r"q8_f32_product\(", ("prefetcht0",)))
    missing = [
        f"{kernel} ({pattern}): no {hint}"
        for kernel, pattern, hints in wanted
        for hint in hints
        if not any(re.search(pattern, name) and counts.get(hint) for name, counts in found.items())
    ]
    assert not missing, f"prefetches compiled out of {native.__file__}: {missing}"
