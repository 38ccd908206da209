"""Transparent huge pages for what a CPU worker reads every step: the model's weights and
the KV cache.

A decode step streams every weight (~96 MB for SmolLM2's Q4_1 file) and every running
sequence's K/V (~300 MB at 64 sequences of ~200 tokens) through the TLB. On 4 KiB
pages that is a page walk every 4 KiB of weights and one or two per K/V block; on 2 MiB
pages, one per 2 MiB. Linux backs an anonymous mapping with huge pages where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``, or ``madvise`` and the
range was advised ``MADV_HUGEPAGE`` before it was touched (the common default, and this
module's case). Measured on a 2-core Xeon with AMX (fast mode, 3 alternating runs each):
a decode step of 1 sequence at ~200 tokens of context 7.4-8.0 ms against 9.1-9.9 on 4 KiB
pages; of 64 sequences 49.7-51.3 against 51.3-53.8 (noisier: 52.5 against 52.4-55.5 in
a later set). Weights alone on huge pages, the KV cache not, measured no gain at 64.

Where huge pages cannot be had (not Linux, ``never``), the same tensors are ordinary
memory: nothing else changes. Tensors placed here are plain CPU tensors over an
anonymous ``mmap``, which they keep alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes (x86-64's transparent huge page)
_ALIGN = 64  # bytes between tensors placed in one arena (a cache line)
_MIN_BYTES = 4096  # smaller storages stay where they are
#: Bytes moved between heap trims (``trim_heap``): the move holds at most this much twice.
_TRIM_EVERY = 64 * 2**20
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_mode() -> str:
    """This machine's transparent huge page setting (``always``, ``madvise``,
    ``never``), or ``unavailable`` where there is none to read."""
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def huge_pages_usable() -> bool:
    """Whether memory advised ``MADV_HUGEPAGE`` here can get huge pages (Linux, THP
    ``always`` or ``madvise``)."""
    return (
        sys.platform == "linux"
        and hasattr(mmap, "MADV_HUGEPAGE")
        and huge_pages_mode() in ("always", "madvise")
    )


def huge_empty(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of ``nbytes`` (fresh anonymous memory: its pages are
    faulted in on first touch), 2 MiB-aligned and advised ``MADV_HUGEPAGE`` before
    any page is touched; ``torch.zeros`` where huge pages are not usable."""
    if nbytes < 0:
        raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
    if nbytes == 0 or not huge_pages_usable():
        return torch.zeros(nbytes, dtype=torch.uint8)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        region = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as error:  # e.g. strict overcommit: torch's allocator decides instead
        logger.debug("mmap of %d bytes failed: %s", length + HUGE_PAGE, error)
        return torch.zeros(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive
    offset = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, length)
    except OSError as error:  # e.g. a kernel built without THP: ordinary pages
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", error)
    return whole[offset : offset + nbytes]


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on huge pages where they are usable, every
    page faulted in now, as ``torch.zeros`` writes every page. Left to fault in as a
    worker's steps first touched its blocks, each 2 MiB fault (with the kernel compacting
    memory for it) cost a decode step of 64 sequences ~3-5% (52-55 ms against 50-51)."""
    if not huge_pages_usable():
        return torch.zeros(shape, dtype=dtype)
    return huge_empty(math.prod(shape) * dtype.itemsize).zero_().view(dtype).view(shape)


def move_to_huge_pages(root: object) -> int:
    """Re-home the storage of every CPU tensor reachable from ``root`` (a module, its
    parameters, buffers and attributes, tessera objects they hold such as packed weights,
    and the bases of views) into one huge-page arena, in place (``Tensor.set_``: the same
    tensor objects; every tensor over a storage moves with it, so views stay views).
    Storages under 4 KiB stay, and so does a storage that any tensor over it pins
    (requires grad, an inference tensor, a dtype that does not divide it). Returns the
    arena's bytes (each storage rounded up to 64); 0 where huge pages are not usable.
    Call it before anything keeps raw pointers to the tensors (the native layer stack
    is built on first use, after loading). A moved storage that something outside
    ``root`` still holds stays in memory too: that is logged."""
    if not huge_pages_usable():
        return 0
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}  # by storage: address, bytes
    for tensor in reachable_tensors(root):
        if tensor.device.type == "cpu" and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            groups.setdefault((storage.data_ptr(), storage.nbytes()), []).append(tensor)
    moving = [
        tensors
        for (_, nbytes), tensors in groups.items()
        if nbytes >= _MIN_BYTES
        and not any(
            t.requires_grad or t.is_inference() or nbytes % t.element_size() for t in tensors
        )
    ]
    if not moving:
        return 0
    sizes = [tensors[0].untyped_storage().nbytes() for tensors in moving]
    arena = huge_empty(sum(-(-n // _ALIGN) * _ALIGN for n in sizes))
    old_storages = []
    at = 0
    with torch.no_grad():
        for tensors, nbytes in zip(moving, sizes, strict=True):
            old = tensors[0].untyped_storage()
            place = arena[at : at + nbytes]
            place.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for tensor in tensors:
                new = place.view(tensor.dtype)
                tensor.set_(
                    new.untyped_storage(),
                    new.storage_offset() + tensor.storage_offset(),
                    tensor.size(),
                    tensor.stride(),
                )
            old_storages.append(StorageWeakRef(old))
            at += -(-nbytes // _ALIGN) * _ALIGN
            old = None  # its last reference here
            if at // _TRIM_EVERY > (at - nbytes) // _TRIM_EVERY:
                trim_heap()  # what the moved storages freed: else the old copies stay held
    held = sum(not ref.expired() for ref in old_storages)
    if held:
        logger.warning(
            "%d of %d storages moved to huge pages are still held elsewhere: their old "
            "copies stay in memory",
            held,
            len(old_storages),
        )
    return at


def trim_heap() -> None:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim``; a
    no-op elsewhere). A storage under glibc's mmap threshold (up to 32 MiB) freed into
    the heap stays resident until then."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reachable_tensors(root: object) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``root`` through modules, tessera objects' attributes
    (``__dict__`` and ``__slots__``; not of a class whose ``holds_weights`` is false,
    such as a tensor-parallel shard's shared memory), lists, tuples and dicts of them,
    and views' bases; each once."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            if obj._base is not None:  # a view's base holds its storage too
                stack.append(obj._base)
        elif isinstance(obj, torch.nn.Module):
            stack += obj.parameters(recurse=False)
            stack += obj.buffers(recurse=False)
            stack += obj.children()
            stack += vars(obj).values()
        elif isinstance(obj, list | tuple):
            stack += obj
        elif isinstance(obj, dict):
            stack += obj.values()
        elif type(obj).__module__.startswith("tessera.") and getattr(obj, "holds_weights", True):
            stack += getattr(obj, "__dict__", {}).values()
            for cls in type(obj).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                names = (slots,) if isinstance(slots, str) else slots
                stack += (getattr(obj, name, None) for name in names)
