"""``HostInts``: a CPU step's integer inputs in a buffer and tensors kept across steps."""

from __future__ import annotations

import pytest
import torch

from tessera.workers.engine.model_runner import HostInts


def test_values_are_cut_into_the_shapes_in_order():
    host = HostInts()
    ids, positions, tables = host.tensors(
        [7, 8, 9, 0, 1, 2, 10, 11, 12, 13, 14, 15], (3, 3, (2, 3))
    )
    assert ids.tolist() == [7, 8, 9] and positions.tolist() == [0, 1, 2]
    assert tables.tolist() == [[10, 11, 12], [13, 14, 15]]
    assert ids.dtype == positions.dtype == tables.dtype == torch.int64


def test_a_layout_seen_before_gives_its_tensors_again_with_the_new_values():
    host = HostInts()
    first = host.tensors([1, 2, 3, 4, 5], (2, 0, 3))
    second = host.tensors([6, 7, 8, 9, 10], (2, 0, 3))
    assert all(a is b for a, b in zip(first, second, strict=True))  # no new tensor
    assert [t.tolist() for t in second] == [[6, 7], [], [8, 9, 10]]
    other = host.tensors([1, 2, 3, 4, 5], (3, 2))  # another layout: its own tensors
    assert [t.tolist() for t in other] == [[1, 2, 3], [4, 5]]
    assert [t.tolist() for t in host.tensors([5, 4, 3, 2, 1], (2, 0, 3))] == [[5, 4], [], [3, 2, 1]]


def test_more_values_than_the_buffer_holds_grow_it():
    host = HostInts()
    small = host.tensors(list(range(10)), (10,))
    (large,) = host.tensors(list(range(10_000)), (10_000,))
    assert large.tolist() == list(range(10_000))
    assert small[0].tolist() == list(range(10))  # the old buffer lives on with its tensor


def test_only_the_newest_layouts_are_kept():
    host = HostInts()
    for n in range(1, HostInts.MAX_LAYOUTS + 6):
        host.tensors(list(range(n)), (n,))
    assert len(host._layouts) == HostInts.MAX_LAYOUTS
    assert (1,) not in host._layouts and (HostInts.MAX_LAYOUTS + 5,) in host._layouts


def test_values_that_do_not_fill_the_shapes_are_refused():
    host = HostInts()
    with pytest.raises(ValueError, match=r"5 values for shapes \(2, \(2, 2\)\) of 6"):
        host.tensors([1, 2, 3, 4, 5], (2, (2, 2)))
    with pytest.raises(ValueError, match=r"7 values for shapes \(2, \(2, 2\)\) of 6"):
        host.tensors([1, 2, 3, 4, 5, 6, 7], (2, (2, 2)))  # a layout kept from before
