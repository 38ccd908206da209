"""The scheduler's prefix index (scheduler/prefix_index.py): stored/evicted events applied
in order, leading-block matching, expected entries and their lapse (with a fake clock),
confirmation by a report, reset with a snapshot, remove and size."""

from __future__ import annotations

from tessera.scheduler.prefix_index import EXPECTED_TTL, PrefixIndex

H1, H2, H3, H4, H5 = (bytes([i]) * 8 for i in range(1, 6))


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def stored(*hashes):
    return [(True, h) for h in hashes]


def evicted(*hashes):
    return [(False, h) for h in hashes]


def test_ttl_is_the_documented_one():
    assert EXPECTED_TTL == 30.0  # the lapse times below assume it


def test_unknown_worker_matches_nothing():
    index = PrefixIndex()
    assert index.matched("w", [H1, H2]) == 0
    assert index.size("w") == 0


def test_stored_events_are_matched():
    index = PrefixIndex()
    index.apply("w", stored(H1, H2, H3))
    assert index.size("w") == 3
    assert index.matched("w", [H1, H2, H3, H4]) == 3
    assert index.matched("w", [H1, H2]) == 2
    assert index.matched("w", []) == 0


def test_events_apply_in_order():
    index = PrefixIndex()
    index.apply("w", [(True, H1), (True, H2), (False, H1)])
    assert index.size("w") == 1
    assert index.matched("w", [H2]) == 1
    assert index.matched("w", [H1, H2]) == 0
    index.apply("w", [(False, H3), (True, H3)])  # evicted then stored again: held
    assert index.size("w") == 2
    assert index.matched("w", [H3]) == 1
    index.apply("w", [(True, H2), (False, H2)])  # stored then evicted: gone
    assert index.size("w") == 1
    assert index.matched("w", [H2]) == 0


def test_events_accumulate_across_reports():
    index = PrefixIndex()
    index.apply("w", stored(H1))
    index.apply("w", stored(H2))
    index.apply("w", [])
    assert index.matched("w", [H1, H2]) == 2
    index.apply("w", evicted(H2))
    assert index.matched("w", [H1, H2]) == 1


def test_matching_stops_at_first_miss():
    index = PrefixIndex()
    index.apply("w", stored(H1, H3, H4))
    assert index.matched("w", [H1, H2, H3, H4]) == 1
    assert index.matched("w", [H2, H3, H4]) == 0
    assert index.matched("w", [H3, H4, H2, H1]) == 2


def test_workers_are_separate():
    index = PrefixIndex()
    index.apply("a", stored(H1, H2))
    index.apply("b", stored(H1))
    assert index.matched("a", [H1, H2]) == 2
    assert index.matched("b", [H1, H2]) == 1
    assert index.size("a") == 2
    assert index.size("b") == 1


def test_expected_entries_count_until_they_lapse():
    clock = FakeClock(1000.0)
    index = PrefixIndex(clock=clock)
    index.expect("w", [H1, H2])
    assert index.size("w") == 0  # expected, not stored
    assert index.matched("w", [H1, H2, H3]) == 2
    clock.now = 1030.0  # exactly at the lapse time: still counts
    assert index.matched("w", [H1, H2]) == 2
    clock.now = 1030.5
    assert index.matched("w", [H1, H2]) == 0


def test_expected_entries_are_per_worker():
    clock = FakeClock()
    index = PrefixIndex(clock=clock)
    index.expect("a", [H1])
    assert index.matched("a", [H1]) == 1
    assert index.matched("b", [H1]) == 0


def test_expected_and_stored_chain_together():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.apply("w", stored(H1))
    index.expect("w", [H1, H2])
    assert index.matched("w", [H1, H2, H3]) == 2
    clock.now = 31.0  # H2 lapsed, H1 is stored
    assert index.matched("w", [H1, H2]) == 1


def test_lapsed_expected_block_in_the_middle_stops_matching():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.expect("w", [H2])
    index.apply("w", stored(H1, H3))
    clock.now = 40.0
    assert index.matched("w", [H1, H2, H3]) == 1


def test_expect_again_extends_the_lapse():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.expect("w", [H1])
    clock.now = 20.0
    index.expect("w", [H1])  # lapses at 50 now
    clock.now = 45.0
    assert index.matched("w", [H1]) == 1
    clock.now = 50.5
    assert index.matched("w", [H1]) == 0


def test_unrelated_report_keeps_unlapsed_expected_entries():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.expect("w", [H1, H2])
    clock.now = 10.0
    index.apply("w", stored(H5))
    assert index.matched("w", [H1, H2]) == 2


def test_report_drops_lapsed_expected_entries():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.expect("w", [H1])
    clock.now = 31.0
    index.apply("w", [])
    clock.now = 0.0  # even were the clock to read early again, the entry is gone
    assert index.matched("w", [H1]) == 0


def test_confirmed_stored_event_replaces_expected_entry():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.expect("w", [H1, H2])
    clock.now = 10.0
    index.apply("w", stored(H1, H2))
    assert index.size("w") == 2
    clock.now = 1000.0  # long past the lapse: stored blocks do not lapse
    assert index.matched("w", [H1, H2]) == 2


def test_evicted_event_drops_expected_entry_before_it_lapses():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.expect("w", [H1, H2])
    clock.now = 5.0
    index.apply("w", evicted(H1))
    assert index.matched("w", [H1, H2]) == 0
    assert index.matched("w", [H2]) == 1


def test_confirmed_then_evicted_block_is_gone():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.expect("w", [H1])
    index.apply("w", stored(H1))
    index.apply("w", evicted(H1))
    assert index.matched("w", [H1]) == 0
    assert index.size("w") == 0


def test_reset_replaces_with_snapshot_and_forgets_expected():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.apply("w", stored(H1, H2))
    index.expect("w", [H3])
    index.reset("w", [H4, H5])
    assert index.size("w") == 2
    assert index.matched("w", [H1]) == 0
    assert index.matched("w", [H3]) == 0
    assert index.matched("w", [H4, H5]) == 2


def test_reset_without_snapshot_empties_the_worker():
    index = PrefixIndex()
    index.apply("w", stored(H1, H2))
    index.reset("w")
    assert index.size("w") == 0
    assert index.matched("w", [H1]) == 0
    index.apply("w", stored(H3))  # reports after the reset apply as usual
    assert index.matched("w", [H3]) == 1


def test_reset_touches_only_that_worker():
    index = PrefixIndex()
    index.apply("a", stored(H1))
    index.apply("b", stored(H1))
    index.reset("a")
    assert index.matched("a", [H1]) == 0
    assert index.matched("b", [H1]) == 1


def test_remove_forgets_stored_and_expected():
    clock = FakeClock(0.0)
    index = PrefixIndex(clock=clock)
    index.apply("a", stored(H1, H2))
    index.expect("a", [H3])
    index.apply("b", stored(H1))
    index.remove("a")
    assert index.size("a") == 0
    assert index.matched("a", [H1]) == 0
    assert index.matched("a", [H3]) == 0
    assert index.size("b") == 1
    assert index.matched("b", [H1]) == 1
    index.remove("never-seen")  # no error
    assert index.size("b") == 1


def test_size_counts_distinct_stored_blocks():
    index = PrefixIndex()
    index.apply("w", stored(H1, H1, H2))
    assert index.size("w") == 2
    index.expect("w", [H3, H4])
    assert index.size("w") == 2
