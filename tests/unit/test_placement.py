"""Placement policies (scheduler/placement.py): PrefixAffinity's prefix-over-load rule and
its spill to the least-loaded worker under each overload condition, RoundRobin's cycle
by worker id, LeastLoaded's ordering, and make_policy's names and error."""

from __future__ import annotations

import pytest

from tessera.scheduler.placement import (
    OVERLOAD_IMBALANCE,
    OVERLOAD_KV_USAGE,
    Candidate,
    LeastLoaded,
    PrefixAffinity,
    RoundRobin,
    make_policy,
)


def cand(worker_id, ongoing=0, capacity=4, kv_usage=0.0, matched=0):
    return Candidate(
        worker_id=worker_id,
        ongoing=ongoing,
        capacity=capacity,
        kv_usage=kv_usage,
        matched_blocks=matched,
    )


def test_thresholds_are_the_documented_ones():
    # the hand-computed cases below assume these values
    assert OVERLOAD_KV_USAGE == 0.95
    assert OVERLOAD_IMBALANCE == 0.5


def test_load_is_ongoing_over_capacity():
    assert cand("a", ongoing=2, capacity=4).load == 0.5
    assert cand("a", ongoing=0, capacity=4).load == 0.0


# ------------------------------------------------------------------ PrefixAffinity
def test_prefix_match_wins_over_load():
    # a: full match, load 0.25, kv 0.5 -> 1 + 0.125 - 0.125 = 1.0
    # b: no match, idle, empty -> 0.25
    a = cand("a", ongoing=1, kv_usage=0.5, matched=4)
    b = cand("b")
    assert PrefixAffinity().choose([b, a], prompt_blocks=4).worker_id == "a"


def test_longer_prefix_match_wins_over_shorter():
    # a: 1/4 matched, idle -> 0.25 + 0.25 = 0.5; b: 3/4 matched, load 0.25 -> 0.75+0.25-0.125
    a = cand("a", matched=1)
    b = cand("b", ongoing=1, matched=3)
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "b"


def test_no_match_goes_to_least_loaded():
    # nothing matched: b has less load and less KV use than a and c
    a = cand("a", ongoing=2, kv_usage=0.5)
    b = cand("b", ongoing=1, kv_usage=0.1)
    c = cand("c", ongoing=3, kv_usage=0.2)
    assert PrefixAffinity().choose([a, b, c], prompt_blocks=4).worker_id == "b"


def test_no_match_with_zero_prompt_blocks_goes_to_least_loaded():
    a = cand("a", ongoing=1)
    b = cand("b")
    assert PrefixAffinity().choose([a, b], prompt_blocks=0).worker_id == "b"


def test_no_match_weighs_headroom_against_load_by_the_score():
    # a: load 0.25, kv 0.9 -> 0.25*0.1 - 0.5*0.25 = -0.1
    # b: load 0.5, kv 0.0 -> 0.25 - 0.25 = 0.0   (higher score, although more loaded)
    a = cand("a", ongoing=1, kv_usage=0.9)
    b = cand("b", ongoing=2, kv_usage=0.0)
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "b"


def test_best_match_with_kv_at_overload_threshold_spills_to_least_loaded():
    a = cand("a", ongoing=1, kv_usage=0.95, matched=4)
    b = cand("b", ongoing=1, kv_usage=0.2)
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "b"


def test_best_match_with_kv_just_below_overload_threshold_stays():
    a = cand("a", ongoing=1, kv_usage=0.94, matched=4)
    b = cand("b", ongoing=1, kv_usage=0.2)
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "a"


def test_best_match_far_busier_than_least_loaded_spills():
    # a: load 0.75, b: load 0.0 -> imbalance 0.75 > 0.5
    a = cand("a", ongoing=3, matched=4)
    b = cand("b")
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "b"


def test_imbalance_is_measured_against_the_least_loaded_not_zero():
    # a: 7/8 = 0.875, b: 2/8 = 0.25 -> 0.625 > 0.5: spill
    a = cand("a", ongoing=7, capacity=8, matched=4)
    b = cand("b", ongoing=2, capacity=8)
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "b"
    # b: 3/8 = 0.375 -> 0.5 exactly: no spill
    b = cand("b", ongoing=3, capacity=8)
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "a"


def test_imbalance_exactly_at_threshold_does_not_spill():
    # a: load 0.5, b: load 0.0 -> imbalance exactly 0.5, not above it
    a = cand("a", ongoing=2, matched=4)
    b = cand("b")
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "a"


def test_spill_goes_to_least_loaded_not_to_the_next_best_match():
    # a: best score (1 + 0.0025 - 0 = 1.0025) but KV 0.99 -> overloaded
    # b: second best match (0.75 + 0.25 - 0.125 = 0.875), load 0.25
    # c: no match, load 0 -> the least loaded
    a = cand("a", kv_usage=0.99, matched=4)
    b = cand("b", ongoing=1, matched=3)
    c = cand("c")
    assert PrefixAffinity().choose([a, b, c], prompt_blocks=4).worker_id == "c"


def test_overloaded_worker_without_match_is_still_chosen_when_best():
    # no match anywhere: the overload rule does not apply; a (busier, but more headroom
    # than b) has score 0.25 - 0.5*0.25 = 0.125, b has 0.25*0.1 - 0 = 0.025
    a = cand("a", ongoing=1)
    b = cand("b", kv_usage=0.9)
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "a"


def test_score_tie_goes_to_least_loaded_not_to_list_order():
    # identical candidates: same score; least_loaded breaks the tie by id -> "a"
    a = cand("a", ongoing=1, kv_usage=0.3, matched=2)
    b = cand("b", ongoing=1, kv_usage=0.3, matched=2)
    assert PrefixAffinity().choose([b, a], prompt_blocks=4).worker_id == "a"
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "a"


def test_score_tie_between_equal_matches_prefers_the_least_loaded_one():
    # a: 2/4 matched, load 0.25, kv 0.5 -> 0.5 + 0.125 - 0.125 = 0.5
    # b: 2/4 matched, load 0.0,  kv 1.0 -> 0.5 + 0.0 - 0.0 = 0.5 (but kv >= 0.95)
    # equal scores; the tie goes to b (least loaded), which is then overloaded -> b anyway
    a = cand("a", ongoing=1, kv_usage=0.5, matched=2)
    b = cand("b", kv_usage=1.0, matched=2)
    assert PrefixAffinity().choose([a, b], prompt_blocks=4).worker_id == "b"


def test_single_candidate_is_chosen_even_when_overloaded():
    a = cand("a", ongoing=3, kv_usage=0.99, matched=4)
    assert PrefixAffinity().choose([a], prompt_blocks=4) is a


# ------------------------------------------------------------------ RoundRobin
def test_round_robin_cycles_by_worker_id():
    policy = RoundRobin()
    workers = [cand("c"), cand("a"), cand("b")]
    chosen = [policy.choose(workers, 4).worker_id for _ in range(7)]
    assert chosen == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_ignores_load_and_matches():
    policy = RoundRobin()
    workers = [cand("a", ongoing=3, matched=0), cand("b", matched=4)]
    assert [policy.choose(workers, 4).worker_id for _ in range(3)] == ["a", "b", "a"]


def test_round_robin_skips_a_worker_not_offered():
    policy = RoundRobin()
    a, b, c = cand("a"), cand("b"), cand("c")
    assert policy.choose([a, b, c], 4).worker_id == "a"
    # b is full: the next worker after a that can take it is c
    assert policy.choose([a, c], 4).worker_id == "c"


def test_round_robin_goes_to_next_id_after_the_last_one_when_a_worker_is_missing():
    policy = RoundRobin()
    a, b, c = cand("a"), cand("b"), cand("c")
    assert [policy.choose([a, b, c], 4).worker_id for _ in range(3)] == ["a", "b", "c"]
    # a is full: after c the next by id is a (not offered), then b
    assert policy.choose([b, c], 4).worker_id == "b"


def test_round_robin_after_a_skip_continues_after_the_chosen_worker():
    policy = RoundRobin()
    a, b, c = cand("a"), cand("b"), cand("c")
    assert policy.choose([a, b, c], 4).worker_id == "a"
    assert policy.choose([a, c], 4).worker_id == "c"  # b skipped
    # all offered again: after c comes a
    assert policy.choose([a, b, c], 4).worker_id == "a"


# ------------------------------------------------------------------ LeastLoaded
def test_least_loaded_orders_by_load_first():
    # kv and id would favour a, load favours c
    a = cand("a", ongoing=2, kv_usage=0.0)
    b = cand("b", ongoing=3, kv_usage=0.0)
    c = cand("c", ongoing=1, kv_usage=0.9, matched=0)
    assert LeastLoaded().choose([a, b, c], 4).worker_id == "c"


def test_least_loaded_compares_load_as_a_share_of_capacity():
    a = cand("a", ongoing=2, capacity=4)  # 0.5
    b = cand("b", ongoing=3, capacity=8)  # 0.375
    assert LeastLoaded().choose([a, b], 4).worker_id == "b"


def test_least_loaded_breaks_load_ties_by_kv_usage():
    a = cand("a", ongoing=1, kv_usage=0.6)
    b = cand("b", ongoing=1, kv_usage=0.3)
    c = cand("c", ongoing=1, kv_usage=0.4)
    assert LeastLoaded().choose([a, b, c], 4).worker_id == "b"


def test_least_loaded_breaks_full_ties_by_worker_id():
    workers = [cand("w2", ongoing=1, kv_usage=0.3), cand("w1", ongoing=1, kv_usage=0.3)]
    assert LeastLoaded().choose(workers, 4).worker_id == "w1"


def test_least_loaded_ignores_prefix_matches():
    a = cand("a", ongoing=1, matched=4)
    b = cand("b")
    assert LeastLoaded().choose([a, b], 4).worker_id == "b"


# ------------------------------------------------------------------ make_policy
def test_make_policy_by_name():
    assert type(make_policy("prefix_affinity")) is PrefixAffinity
    assert type(make_policy("round_robin")) is RoundRobin
    assert type(make_policy("least_loaded")) is LeastLoaded


def test_make_policy_returns_fresh_round_robin_state():
    workers = [cand("a"), cand("b")]
    first = make_policy("round_robin")
    assert first.choose(workers, 4).worker_id == "a"
    second = make_policy("round_robin")
    assert second.choose(workers, 4).worker_id == "a"
    assert first.choose(workers, 4).worker_id == "b"


def test_make_policy_unknown_name():
    with pytest.raises(ValueError) as error:
        make_policy("random")
    assert str(error.value) == (
        "placement: must be one of ['least_loaded', 'prefix_affinity', 'round_robin'], got 'random'"
    )
