"""Weights and KV cache on transparent huge pages (``tessera.workers.hugepages``): the
memory is advised ``MADV_HUGEPAGE`` (the kernel's ``hg`` flag on its mapping, which
``/proc/self/smaps`` shows), and moving tensors there keeps their values, their views
and their identity."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tessera.workers.hugepages import (
    HUGE_PAGE,
    huge_pages_usable,
    huge_zeros,
    move_to_huge_pages,
    reachable_tensors,
)
from tessera.workers.kv.kv_cache import allocate_kv_cache

needs_thp = pytest.mark.skipif(
    not huge_pages_usable(), reason="transparent huge pages are off or absent here"
)


def vm_flags(address: int) -> set[str]:
    """The kernel's flags of the mapping that holds ``address`` (``VmFlags`` in smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_huge_zeros_are_zeros_on_advised_aligned_memory():
    cache = huge_zeros((3, 2, 5, 16, 3, 64), torch.float16)
    assert cache.shape == (3, 2, 5, 16, 3, 64) and cache.dtype == torch.float16
    assert cache.is_contiguous() and not cache.any()
    assert cache.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(cache.data_ptr())
    cache[2, 1, 4].fill_(1.5)  # writable, and the last element is its own
    assert cache.sum().item() == 1.5 * 16 * 3 * 64


@needs_thp
def test_a_cpu_kv_cache_is_on_huge_pages(smollm2):
    cache = allocate_kv_cache(smollm2.config, 4, 16, torch.float16, torch.device("cpu"))
    assert "hg" in vm_flags(cache.data_ptr()) and not cache.any()


@dataclass(eq=False)
class Packed:  # stands for a tessera object holding tensors (tessera.* module)
    __slots__ = ("data", "scales")
    data: torch.Tensor
    scales: torch.Tensor


Packed.__module__ = "tessera.tests.hugepages"


def packed_like_q4() -> Packed:
    """A ``Packed`` whose data is a view of a dropped local (``Q4Weight.nibbles`` is
    made so): the view's ``_base`` holds the storage too."""
    words = torch.arange(1024 * 4, dtype=torch.int32).reshape(1024, 4)
    return Packed(words.view(torch.uint8).reshape(-1), torch.randn(3))


@needs_thp
def test_moving_keeps_values_views_and_identity():
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024)
    model.requires_grad_(False)
    base = torch.randn(64, 64)
    model.register_buffer("table", base)
    model.rows = base[8:16]  # a view of the buffer, held as a plain attribute
    model.packed = Packed(torch.randint(0, 255, (4096,), dtype=torch.uint8), torch.randn(3))
    model.nibbles = packed_like_q4()
    model.small = torch.randn(4)  # below the 4 KiB a storage needs to move
    before = {name: t.clone() for name, t in [("w", model.weight), ("table", base)]}
    expected_nibbles = model.nibbles.data.clone()
    weight, packed_data = model.weight, model.packed.data
    old_nibbles = StorageWeakRef(model.nibbles.data.untyped_storage())
    small_at = model.small.data_ptr()

    moved = move_to_huge_pages(model)

    assert model.weight is weight and model.packed.data is packed_data  # the same objects
    assert torch.equal(model.weight, before["w"]) and torch.equal(model.table, before["table"])
    assert torch.equal(model.nibbles.data, expected_nibbles)
    for tensor in (model.weight, model.table, model.rows, model.packed.data, model.bias):
        assert "hg" in vm_flags(tensor.data_ptr())
    # it stays where it was (its mapping's flags are not asked: which mapping holds a
    # small heap chunk depends on what the process allocated before)
    assert model.small.data_ptr() == small_at
    # the view still shares its buffer's storage
    model.table[8, 0] = 123.0
    assert model.rows[0, 0].item() == 123.0
    # a view's base moved with it: the old storage is gone, not held twice
    nibbles = model.nibbles.data
    assert nibbles._base.untyped_storage().data_ptr() == nibbles.untyped_storage().data_ptr()
    assert old_nibbles.expired()
    # weight, bias, table, packed, nibbles
    expected = (512 * 1024 * 4, 1024 * 4, 64 * 64 * 4, 4096, 1024 * 4 * 4)
    assert moved == sum(-(-n // 64) * 64 for n in expected)
    assert torch.equal(model(torch.ones(2, 512)), torch.ones(2, 512) @ before["w"].T + model.bias)


@needs_thp
def test_the_heap_is_trimmed_while_moving_up_to_the_last_storage(monkeypatch):
    """Every storage crosses a trim boundary (``_TRIM_EVERY`` of a few KiB): the heap is
    trimmed after each, the last included, and every value arrives."""
    from tessera.workers import hugepages

    trims = []
    monkeypatch.setattr(hugepages, "_TRIM_EVERY", 4096)
    monkeypatch.setattr(hugepages, "trim_heap", lambda: trims.append(1))
    model = torch.nn.Module()
    tensors = [torch.randn(2048) for _ in range(3)]  # 8 KiB each
    for i, tensor in enumerate(tensors):
        model.register_buffer(f"t{i}", tensor.clone())
    assert move_to_huge_pages(model) == 3 * 8192
    assert len(trims) == 3
    for i, tensor in enumerate(tensors):
        assert torch.equal(getattr(model, f"t{i}"), tensor)


@needs_thp
def test_a_storage_held_elsewhere_is_moved_and_logged(caplog):
    model = torch.nn.Module()
    model.register_buffer("table", torch.randn(64, 64))
    outside = model.table.view(-1)  # not reachable from the model: pins the old storage
    with caplog.at_level(logging.WARNING, logger="tessera.workers.hugepages"):
        assert move_to_huge_pages(model) == 64 * 64 * 4
    assert "1 of 1 storages moved to huge pages are still held elsewhere" in caplog.text
    assert torch.equal(outside.view(64, 64), model.table)  # a copy: the values are equal
    assert outside.data_ptr() != model.table.data_ptr()


_WITHOUT_HUGE_PAGES = """
import torch
from tessera.workers import hugepages
from tessera.workers.hugepages import huge_zeros, move_to_huge_pages
from tests.unit.test_hugepages import vm_flags

hugepages.huge_pages_usable = lambda: False
model = torch.nn.Linear(512, 1024)
model.requires_grad_(False)
address = model.weight.data_ptr()
assert move_to_huge_pages(model) == 0 and model.weight.data_ptr() == address
cache = huge_zeros((2, 3, 4096 * 1024), torch.float16)
assert cache.shape == (2, 3, 4096 * 1024) and not cache.any()
print(sorted(vm_flags(cache.data_ptr())))
"""


@pytest.mark.skipif(
    not Path("/proc/self/smaps").exists(), reason="reads the mappings' flags (Linux only)"
)
def test_without_huge_pages_nothing_moves():
    # In a fresh process: in this one, a 48 MiB tensor may come from free heap space
    # (glibc reuses it before it maps anew) in a range that earlier code advised, so
    # its mapping's flags would tell this process's history, not huge_zeros's behaviour.
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_HUGE_PAGES],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr
    flags = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert "rd" in flags and "hg" not in flags


@needs_thp
def test_a_loaded_models_weights_are_on_huge_pages(smollm2):
    tensors = [t for t in reachable_tensors(smollm2.model) if t.untyped_storage().nbytes() >= 4096]
    assert len(tensors) > 30 * 4  # every layer's packed matrices, at least
    assert all("hg" in vm_flags(t.data_ptr()) for t in tensors)
