"""The Responses API's store (over a process's own key-value store, as it is over the
GCS): bounded (a replica's oldest go first), expiring, swept, and the chat messages a
stored conversation becomes."""

from __future__ import annotations

import pytest

from tessera.cluster import response_store
from tessera.cluster.openai_responses_api import chat_messages
from tessera.cluster.response_store import MemoryKeyValue, ResponseStore

PREFIX = "tessera/test/responses/"


def _response(n: int) -> dict:
    return {"id": f"resp_{n}", "object": "response"}


def test_the_oldest_go_first_past_the_bound():
    kv = MemoryKeyValue()
    store = ResponseStore(kv, PREFIX, size=2, ttl_s=60)
    other = ResponseStore(kv, PREFIX, size=2, ttl_s=60)  # another replica's
    other.put(_response(9), [])
    for n in range(3):
        store.put(_response(n), [])
    assert sorted(kv.values) == [PREFIX + "resp_1", PREFIX + "resp_2", PREFIX + "resp_9"]
    assert store.get("resp_0") is None
    assert store.get("resp_2").response == _response(2) == other.get("resp_2").response
    assert other.delete("resp_1") and not store.delete("resp_1")
    assert store.get("x" * 1000) is None and not store.delete("x" * 1000)


def test_entries_expire_after_the_ttl(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(response_store.time, "time", lambda: now[0])
    kv = MemoryKeyValue()
    store = ResponseStore(kv, PREFIX, size=8, ttl_s=10)
    gone = ResponseStore(kv, PREFIX, size=8, ttl_s=10)  # a replica that stopped
    gone.put(_response(7), [])
    store.put(_response(0), [{"role": "user", "content": "hi"}])
    now[0] = 105.0
    store.put(_response(1), [])
    assert store.get("resp_0").items == [{"role": "user", "content": "hi"}]
    now[0] = 110.0
    assert store.get("resp_0") is None and store.get("resp_1") is not None
    assert sorted(kv.values) == [PREFIX + "resp_1", PREFIX + "resp_7"]
    assert store.sweep() == 1  # resp_7's, which nobody read
    assert sorted(kv.values) == [PREFIX + "resp_1"]
    now[0] = 116.0
    store.put(_response(2), [])  # a writer deletes its own expired ones
    assert sorted(kv.values) == [PREFIX + "resp_2"]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        ResponseStore(MemoryKeyValue(), PREFIX, size=0)
    with pytest.raises(ValueError):
        ResponseStore(MemoryKeyValue(), PREFIX, ttl_s=0)


def test_calls_join_their_assistant_turn_and_outputs_become_tool_messages():
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather "},
                {"type": "input_text", "text": "in Oslo?"},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Cold."}],
        },
    ]
    call = {"type": "function"}
    assert chat_messages(items) == [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", **call, "function": {"name": "w", "arguments": "{}"}},
                {"id": "c2", **call, "function": {"name": "t", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "assistant", "content": "Cold."},
    ]


def test_any_json_a_request_sent_is_stored_whole():
    """A stored conversation keeps whatever JSON its items held (a client's content parts
    carry free-form annotations): integers past 64 bits and lone surrogates included."""
    store = ResponseStore(MemoryKeyValue(), PREFIX, size=2, ttl_s=60)
    items = [{"role": "user", "content": [{"annotations": [2**200, -(2**70)], "text": "\udb36"}]}]
    store.put(_response(0), items)
    assert store.get("resp_0").items == items
