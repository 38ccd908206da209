"""Autoscaling decisions (scheduler/autoscaler.py): scale-up after sustained pressure
(queue, engine waiting, mean ongoing requests, mean KV usage), none while a worker
starts, one at a time, within max_workers counting starting workers; replacement up to
min_workers; draining the longest-idle worker, never under pressure and never below
min_workers, with draining members not counted as active. Per role (PoolPolicy.for_role):
prefill pools by queued prompt tokens only, decode pools by running sequences, ongoing
requests and KV usage; a draining member stops only once nothing needs it and it is idle."""

from __future__ import annotations

import math

import pytest

from tessera.scheduler.autoscaler import Autoscaler, Decision, PoolMember, PoolPolicy


def policy(min_workers=1, max_workers=3, up=10.0, down=60.0, target=0.8):
    return PoolPolicy(
        min_workers=min_workers,
        max_workers=max_workers,
        upscale_delay_s=up,
        downscale_delay_s=down,
        target_kv_usage=target,
    )


def member(
    worker_id,
    starting=False,
    draining=False,
    ongoing=0,
    waiting=0,
    kv_usage=0.0,
    idle_since=None,
    running=0,
    queued_prompt_tokens=0,
):
    return PoolMember(
        worker_id=worker_id,
        starting=starting,
        draining=draining,
        ongoing=ongoing,
        waiting=waiting,
        kv_usage=kv_usage,
        idle_since=idle_since,
        running=running,
        queued_prompt_tokens=queued_prompt_tokens,
    )


def role_policy(role, min_workers=1, max_workers=3, up=0.0, down=60.0):
    return PoolPolicy.for_role(
        role,
        min_workers=min_workers,
        max_workers=max_workers,
        upscale_delay_s=up,
        downscale_delay_s=down,
        target_kv_usage=0.8,
        target_ongoing_requests=4,
        target_prefill_queue_tokens=1000,
    )


def busy(worker_id, **kwargs):
    return member(worker_id, ongoing=1, **kwargs)


NOTHING = Decision()
ADD_ONE = Decision(add=1)


# ------------------------------------------------------------------ scale up
def test_no_scale_up_before_pressure_has_lasted():
    scaler = Autoscaler(policy(up=10.0))
    members = [busy("a")]
    assert scaler.decide(100.0, members, queued=1) == NOTHING
    assert scaler.decide(105.0, members, queued=3) == NOTHING
    assert scaler.decide(109.9, members, queued=1) == NOTHING
    assert scaler.decide(110.0, members, queued=1) == ADD_ONE


def test_one_worker_per_decision_then_the_clock_restarts():
    scaler = Autoscaler(policy(up=10.0, max_workers=5))
    members = [busy("a")]
    assert scaler.decide(0.0, members, queued=50) == NOTHING
    assert scaler.decide(10.0, members, queued=50) == ADD_ONE
    members = [busy("a"), member("b", starting=True)]
    assert scaler.decide(11.0, members, queued=50) == NOTHING  # none while b starts
    assert scaler.decide(40.0, members, queued=50) == NOTHING
    members = [busy("a"), busy("b")]  # b is up: the clock starts again here
    assert scaler.decide(41.0, members, queued=50) == NOTHING
    assert scaler.decide(50.5, members, queued=50) == NOTHING
    assert scaler.decide(51.0, members, queued=50) == ADD_ONE


def test_interrupted_pressure_restarts_the_clock():
    scaler = Autoscaler(policy(up=10.0))
    members = [busy("a")]
    assert scaler.decide(0.0, members, queued=1) == NOTHING
    assert scaler.decide(5.0, members, queued=0) == NOTHING  # pressure gone
    assert scaler.decide(8.0, members, queued=1) == NOTHING
    assert scaler.decide(17.9, members, queued=1) == NOTHING
    assert scaler.decide(18.0, members, queued=1) == ADD_ONE


def test_zero_delay_adds_on_first_pressure():
    scaler = Autoscaler(policy(up=0.0))
    assert scaler.decide(0.0, [busy("a")], queued=1) == ADD_ONE


def test_no_pressure_no_scale_up():
    scaler = Autoscaler(policy(up=0.0))
    members = [busy("a", kv_usage=0.5), busy("b", kv_usage=0.7)]
    assert scaler.decide(0.0, members, queued=0) == NOTHING
    assert scaler.decide(1000.0, members, queued=0) == NOTHING


def test_pressure_from_engine_waiting():
    scaler = Autoscaler(policy(up=0.0))
    members = [busy("a"), busy("b", waiting=2)]
    assert scaler.decide(0.0, members, queued=0) == ADD_ONE


def test_pressure_from_mean_kv_usage_above_target():
    scaler = Autoscaler(policy(max_workers=5, up=0.0, target=0.75))
    members = [busy("a", kv_usage=0.5), busy("b", kv_usage=1.0)]  # mean 0.75: not above
    assert scaler.decide(0.0, members, queued=0) == NOTHING
    members = [busy("a", kv_usage=0.5), busy("b", kv_usage=1.0), busy("c", kv_usage=1.0)]
    assert scaler.decide(1.0, members, queued=0) == ADD_ONE  # mean 0.8333


def test_pressure_from_mean_ongoing_requests_above_target():
    limit = PoolPolicy(1, 3, 0.0, 60.0, 0.8, target_ongoing_requests=2)
    scaler = Autoscaler(limit)
    members = [member("a", ongoing=3), member("b", ongoing=1)]  # mean 2: not above
    assert scaler.decide(0.0, members, queued=0) == NOTHING
    members = [member("a", ongoing=3), member("b", ongoing=2)]  # mean 2.5
    assert scaler.decide(1.0, members, queued=0) == ADD_ONE


def test_one_full_worker_is_not_pressure_when_the_mean_is_low():
    scaler = Autoscaler(policy(up=0.0, target=0.8))
    members = [busy("a", kv_usage=1.0), busy("b", kv_usage=0.0)]  # mean 0.5
    assert scaler.decide(0.0, members, queued=0) == NOTHING


def test_no_scale_up_while_a_worker_is_starting():
    scaler = Autoscaler(policy(up=0.0, target=0.8, max_workers=5))
    # a alone is at 0.9 > 0.8, but b is starting and will take its share
    members = [busy("a", kv_usage=0.9), member("b", starting=True, kv_usage=0.0)]
    assert scaler.decide(0.0, members, queued=3) == NOTHING
    # once b is up the mean is 0.45 and nothing is queued: no pressure
    members = [busy("a", kv_usage=0.9), busy("b", kv_usage=0.0)]
    assert scaler.decide(1.0, members, queued=0) == NOTHING


def test_draining_workers_do_not_make_pressure():
    scaler = Autoscaler(policy(min_workers=1, up=0.0, target=0.8))
    members = [busy("a", kv_usage=0.1), busy("b", draining=True, waiting=4, kv_usage=1.0)]
    assert scaler.decide(0.0, members, queued=0) == NOTHING


def test_starting_workers_count_toward_max():
    scaler = Autoscaler(policy(max_workers=2, up=0.0))
    members = [busy("a"), member("b", starting=True)]
    assert scaler.decide(0.0, members, queued=5) == NOTHING
    assert scaler.decide(100.0, members, queued=5) == NOTHING


def test_never_above_max_then_adds_once_below_it():
    scaler = Autoscaler(policy(min_workers=1, max_workers=2, up=10.0))
    full = [busy("a"), busy("b")]
    for now in (0.0, 10.0, 50.0, 500.0):
        assert scaler.decide(now, full, queued=9) == NOTHING
    # b went away while pressure lasted all along: room for one
    assert scaler.decide(501.0, [busy("a")], queued=9) == ADD_ONE


def test_draining_members_leave_room_below_max():
    scaler = Autoscaler(policy(min_workers=1, max_workers=2, up=0.0))
    members = [busy("a"), busy("b", draining=True)]
    assert scaler.decide(0.0, members, queued=1) == ADD_ONE


# ------------------------------------------------------------------ replacement
def test_replaces_up_to_min_workers():
    scaler = Autoscaler(policy(min_workers=3, max_workers=5))
    assert scaler.decide(0.0, [busy("a")], queued=0) == Decision(add=2)
    assert scaler.decide(0.0, [], queued=0) == Decision(add=3)
    members = [busy("a"), member("b", starting=True), member("c", idle_since=0.0)]
    assert scaler.decide(0.0, members, queued=0) == NOTHING


def test_replacement_counts_draining_members_as_gone():
    scaler = Autoscaler(policy(min_workers=2, max_workers=3))
    members = [busy("a"), busy("b", draining=True)]
    assert scaler.decide(0.0, members, queued=0) == Decision(add=1)


def test_replacement_does_not_wait_for_the_delay_and_restarts_the_clock():
    scaler = Autoscaler(policy(min_workers=2, max_workers=4, up=10.0))
    two = [busy("a"), busy("b")]
    assert scaler.decide(0.0, two, queued=1) == NOTHING
    assert scaler.decide(5.0, [busy("a")], queued=1) == Decision(add=1)
    # the pressure clock restarted at the replacement: it starts again at 6
    assert scaler.decide(6.0, two, queued=1) == NOTHING
    assert scaler.decide(15.9, two, queued=1) == NOTHING
    assert scaler.decide(16.0, two, queued=1) == ADD_ONE


# ------------------------------------------------------------------ scale down
def test_drains_a_worker_idle_for_the_delay():
    scaler = Autoscaler(policy(min_workers=1, down=60.0))
    members = [busy("a"), member("b", idle_since=100.0)]
    assert scaler.decide(159.9, members, queued=0) == NOTHING
    assert scaler.decide(160.0, members, queued=0) == Decision(drain=("b",))


def test_drains_the_longest_idle_first_and_one_at_a_time():
    scaler = Autoscaler(policy(min_workers=1, down=60.0))
    members = [
        member("a", idle_since=50.0),
        member("b", idle_since=10.0),
        member("c", idle_since=30.0),
        busy("d"),
    ]
    assert scaler.decide(200.0, members, queued=0) == Decision(drain=("b",))


def test_only_workers_past_the_delay_are_drained():
    scaler = Autoscaler(policy(min_workers=1, down=60.0))
    members = [member("a", idle_since=80.0), member("b", idle_since=50.0), busy("c")]
    assert scaler.decide(109.0, members, queued=0) == NOTHING  # a idle 29 s, b 59 s
    assert scaler.decide(110.0, members, queued=0) == Decision(drain=("b",))  # b 60 s


def test_equal_idle_time_drains_the_highest_id():
    scaler = Autoscaler(policy(min_workers=1, down=60.0))
    members = [member("w1", idle_since=0.0), member("w3", idle_since=0.0), busy("w2")]
    assert scaler.decide(100.0, members, queued=0) == Decision(drain=("w3",))


def test_never_drains_down_to_below_min_workers():
    scaler = Autoscaler(policy(min_workers=2, down=60.0))
    members = [member("a", idle_since=0.0), member("b", idle_since=0.0)]
    assert scaler.decide(1000.0, members, queued=0) == NOTHING
    members.append(member("c", idle_since=0.0))
    assert scaler.decide(1000.0, members, queued=0) == Decision(drain=("c",))


def test_draining_members_do_not_count_as_active_for_scale_down():
    scaler = Autoscaler(policy(min_workers=1, down=60.0))
    # a is already draining: b is the only active worker, at the floor
    members = [member("a", draining=True, idle_since=0.0), member("b", idle_since=0.0)]
    assert scaler.decide(1000.0, members, queued=0) == NOTHING


def test_draining_member_is_not_drained_again():
    scaler = Autoscaler(policy(min_workers=1, down=60.0))
    members = [
        member("a", draining=True, idle_since=0.0),
        member("b", idle_since=500.0),
        busy("c"),
    ]
    assert scaler.decide(1000.0, members, queued=0) == Decision(drain=("b",))


def test_starting_members_are_not_drained():
    scaler = Autoscaler(policy(min_workers=1, max_workers=3, down=60.0))
    members = [member("a", starting=True, idle_since=0.0), busy("b")]
    assert scaler.decide(1000.0, members, queued=0) == NOTHING


def test_never_drains_while_queue_pressure():
    scaler = Autoscaler(policy(min_workers=1, max_workers=2, up=10.0, down=60.0))
    members = [member("a", idle_since=0.0), busy("b")]
    assert scaler.decide(1000.0, members, queued=1) == NOTHING  # pressure just started
    assert scaler.decide(1005.0, members, queued=1) == NOTHING


def test_never_drains_while_engine_waiting_at_max():
    scaler = Autoscaler(policy(min_workers=1, max_workers=2, up=0.0, down=60.0))
    members = [member("a", idle_since=0.0), busy("b", waiting=1)]
    assert scaler.decide(1000.0, members, queued=0) == NOTHING


def test_never_drains_while_kv_pressure():
    scaler = Autoscaler(policy(min_workers=1, max_workers=2, up=100.0, down=60.0, target=0.4))
    members = [member("a", idle_since=0.0, kv_usage=0.0), busy("b", kv_usage=1.0)]  # mean 0.5
    assert scaler.decide(1000.0, members, queued=0) == NOTHING


def test_drains_once_pressure_is_gone():
    scaler = Autoscaler(policy(min_workers=1, max_workers=2, up=100.0, down=60.0))
    members = [member("a", idle_since=0.0), busy("b")]
    assert scaler.decide(1000.0, members, queued=1) == NOTHING
    assert scaler.decide(1001.0, members, queued=0) == Decision(drain=("a",))


# ------------------------------------------------------------------ per role
def test_each_role_watches_its_own_signals():
    inf = math.inf
    prefill, decode, mixed = (role_policy(r) for r in ("prefill", "decode", "mixed"))
    assert (
        prefill.target_queued_prompt_tokens,
        prefill.target_kv_usage,
        prefill.target_ongoing_requests,
        prefill.target_running_sequences,
    ) == (1000, inf, inf, inf)
    assert (
        decode.target_queued_prompt_tokens,
        decode.target_kv_usage,
        decode.target_ongoing_requests,
        decode.target_running_sequences,
    ) == (inf, 0.8, 4, 4)
    assert (
        mixed.target_queued_prompt_tokens,
        mixed.target_kv_usage,
        mixed.target_ongoing_requests,
        mixed.target_running_sequences,
    ) == (inf, 0.8, 4, inf)
    with pytest.raises(ValueError, match="role: must be one of"):
        role_policy("both")


def test_prefill_pool_scales_up_on_mean_queued_prompt_tokens_above_target():
    scaler = Autoscaler(role_policy("prefill", up=1.0))
    under = [member("p0", queued_prompt_tokens=1500), member("p1", queued_prompt_tokens=500)]
    assert scaler.decide(0.0, under, queued=0) == NOTHING  # mean 1000: not above
    over = [member("p0", queued_prompt_tokens=1500), member("p1", queued_prompt_tokens=600)]
    assert scaler.decide(1.0, over, queued=0) == NOTHING  # pressure starts here
    assert scaler.decide(2.0, over, queued=0) == ADD_ONE  # and lasted upscale_delay_s


def test_prefill_pool_ignores_kv_usage_ongoing_and_running():
    scaler = Autoscaler(role_policy("prefill"))
    # its blocks stay cached for the next turn, and its paired requests decode elsewhere
    members = [member("p0", kv_usage=1.0, ongoing=50, running=30, queued_prompt_tokens=999)]
    assert scaler.decide(0.0, members, queued=0) == NOTHING


def test_decode_pool_scales_up_on_running_sequences_above_target():
    scaler = Autoscaler(role_policy("decode"))
    # two requests of n=4 each: 8 running sequences, 2 ongoing requests (target 4)
    members = [member("d0", ongoing=2, running=8), member("d1", ongoing=0, running=0)]
    assert scaler.decide(0.0, members, queued=0) == NOTHING  # mean running 4: not above
    members = [member("d0", ongoing=2, running=8), member("d1", ongoing=1, running=2)]
    assert scaler.decide(1.0, members, queued=0) == ADD_ONE  # mean running 5


def test_decode_pool_scales_up_on_kv_usage_and_queue_but_not_on_prompt_tokens():
    scaler = Autoscaler(role_policy("decode"))
    assert scaler.decide(0.0, [member("d0", queued_prompt_tokens=10**6)], queued=0) == NOTHING
    assert scaler.decide(1.0, [busy("d0", kv_usage=0.9)], queued=0) == ADD_ONE
    assert scaler.decide(2.0, [busy("d0")], queued=1) == ADD_ONE


def test_mixed_pool_ignores_running_sequences_and_prompt_tokens():
    scaler = Autoscaler(role_policy("mixed"))
    members = [member("m0", ongoing=1, running=40, queued_prompt_tokens=10**6)]
    assert scaler.decide(0.0, members, queued=0) == NOTHING


def test_an_idle_prefill_worker_is_drained_while_requests_it_prefilled_still_decode():
    scaler = Autoscaler(role_policy("prefill", down=60.0))
    # p1's own work ended at 0 (it reports idle); 3 requests it prefilled still decode
    members = [member("p0", idle_since=None, running=1), member("p1", ongoing=3, idle_since=0.0)]
    assert scaler.decide(60.0, members, queued=0) == Decision(drain=("p1",))


# ------------------------------------------------------------------ stopping
def test_a_draining_member_stops_once_nothing_needs_it_and_it_is_idle():
    assert member("a", draining=True, idle_since=5.0).stoppable
    assert not member("a", draining=False, idle_since=5.0).stoppable  # active
    # a prefill worker paired with a placed request: its decode worker may still pull
    assert not member("p", draining=True, ongoing=1, idle_since=5.0).stoppable
    # a prefill worker whose own report says it has work (a pull it serves)
    assert not member("p", draining=True, ongoing=0, idle_since=None).stoppable


def test_pool_policy_checks_its_bounds():
    with pytest.raises(
        ValueError, match=r"min_workers: must be between 0 and max_workers \(2\), got 3"
    ):
        PoolPolicy(3, 2, 0.0, 0.0)
    with pytest.raises(ValueError, match="downscale_delay_s: must be >= 0, got -1"):
        PoolPolicy(1, 2, 0.0, -1)
