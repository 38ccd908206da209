"""The one table of sampling fields (``tessera.workers.decoding.sampling_fields``): it covers
every ``SamplingParams`` field, matches the gRPC message and the HTTP bodies, and
maps both ways without loss; and a fork's seed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tessera.cluster.grpc_api import sampling_params as grpc_sampling_params
from tessera.cluster.grpc_client import generate_request
from tessera.cluster.openai_protocol import (
    HTTP_NAMES,
    ChatCompletionRequest,
    CompletionRequest,
    ParallelTokensBody,
    SpeculativeBody,
    parse_body,
)
from tessera.protos.tessera.v1 import generation_pb2 as pb
from tessera.protos.tessera.v1 import kv_transfer_pb2
from tessera.workers.api import (
    InvalidRequestError,
    ParallelTokensParams,
    SamplingParams,
    SpeculativeParams,
    StructuredParams,
    fork_seed,
)
from tessera.workers.decoding.sampling_fields import (
    BY_NAME,
    FIELDS,
    NOT_ON_THE_WIRE,
    WIRE_NAMES,
    defaults,
    message_values,
    options_message,
    sampling_params,
    wire_values,
)

#: Every field away from its default (and valid together).
SAMPLED = SamplingParams(
    max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.875, top_k=40, min_p=0.125,
    repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.5, seed=2**62 + 3,
    stop=("END", "\n\n"), stop_token_ids=(7, 9), ignore_eos=True, logprobs=3,
    logit_bias=((5, -100.0), (17, 2.5)), prompt_logprobs=2,
    skip_special_tokens=False, n=2, best_of=3,
)  # fmt: skip
SPECULATING = SamplingParams(
    temperature=0.0, speculative=SpeculativeParams("draft", 6, adaptive=False)
)
PARALLEL = SamplingParams(parallel_tokens=ParallelTokensParams(0.25, 3, "visible"))
BEAMS = SamplingParams(beam_width=4, n=2, length_penalty=0.5, early_stopping=True)
STRUCTURED = SamplingParams(n=2, structured=StructuredParams("regex", r"\d+"))
EXAMPLES = [SamplingParams(), SAMPLED, SPECULATING, PARALLEL, BEAMS, STRUCTURED]


# ------------------------------------------------------------------ the table
def test_every_sampling_params_field_is_on_the_wire_or_listed_as_not():
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert [f.name for f in FIELDS] == [n for n in names if n not in NOT_ON_THE_WIRE]
    assert set(names) == WIRE_NAMES | NOT_ON_THE_WIRE
    assert not WIRE_NAMES & NOT_ON_THE_WIRE


def test_the_grpc_message_holds_exactly_the_table():
    for message in (pb.SamplingOptions, kv_transfer_pb2.PullBlocksRequest().sampling):
        descriptor = message.DESCRIPTOR
        assert set(descriptor.fields_by_name) == WIRE_NAMES
        for field in descriptor.fields:
            wire = BY_NAME[field.name]
            is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
            assert is_map == wire.mapping, field.name
            assert (field.is_repeated and not is_map) == wire.repeated, field.name
            message = field.message_type is not None and not is_map
            assert message == (wire.nested is not None), field.name
            if wire.nested is not None:
                nested = {f.name for f in dataclasses.fields(wire.nested)}
                assert set(field.message_type.fields_by_name) == nested


@pytest.mark.parametrize("body", [CompletionRequest, ChatCompletionRequest])
def test_the_http_bodies_take_every_wire_name_with_the_engines_defaults(body):
    assert set(body.model_fields) >= WIRE_NAMES - set(HTTP_NAMES)
    assert set(body.model_fields) >= {n for names in HTTP_NAMES.values() for n in names}
    engine = defaults(SamplingParams)
    for name in WIRE_NAMES - set(HTTP_NAMES):
        default = body.model_fields[name].default
        if default is not None and name != "logprobs":  # chat's logprobs is a bool
            assert default == engine[name], name
    for nested, kind in (
        (SpeculativeBody, SpeculativeParams),
        (ParallelTokensBody, ParallelTokensParams),
    ):
        assert {n: f.default for n, f in nested.model_fields.items()} == defaults(kind)


# ------------------------------------------------------------------ both ways
@pytest.mark.parametrize("params", EXAMPLES)
def test_params_round_trip_through_values_and_the_message(params):
    assert sampling_params(wire_values(params)) == params
    message = options_message(pb.SamplingOptions, params)
    assert sampling_params(message_values(message)) == params
    again = pb.SamplingOptions.FromString(message.SerializeToString())
    assert grpc_sampling_params(again) == params


def test_beam_search_never_stops_early_only_off_the_proto():
    params = dataclasses.replace(BEAMS, early_stopping="never")
    assert sampling_params(wire_values(params)) == params
    with pytest.raises(TypeError):  # SamplingOptions.early_stopping is a bool
        options_message(pb.SamplingOptions, params)


def test_unset_values_take_the_defaults():
    assert sampling_params({}) == SamplingParams()
    assert sampling_params(dict.fromkeys(WIRE_NAMES)) == SamplingParams()
    assert message_values(pb.SamplingOptions()) == {}
    assert wire_values(SamplingParams())["max_tokens"] == 16
    assert "seed" not in wire_values(SamplingParams())  # None: unset
    # a set but empty nested message: that feature with all its defaults
    message = pb.SamplingOptions(speculative=pb.SpeculativeOptions())
    assert message_values(message) == {"speculative": {}}
    assert sampling_params(message_values(message)).speculative == SpeculativeParams()
    nested = {"speculative": {"method": None, "num_tokens": 2}}
    assert sampling_params(nested).speculative == SpeculativeParams(num_tokens=2)


def test_lists_become_tuples_and_nested_values_their_params():
    params = sampling_params(
        {"stop": ["a"], "stop_token_ids": [3], "parallel_tokens": {"max_width": 2}}
    )
    assert (params.stop, params.stop_token_ids) == (("a",), (3,))
    assert params.parallel_tokens == ParallelTokensParams(max_width=2)
    given = ParallelTokensParams(0.5)
    assert sampling_params({"parallel_tokens": given}).parallel_tokens is given


def test_bad_values_are_refused_by_name_and_unknown_names_are_type_errors():
    with pytest.raises(InvalidRequestError) as caught:
        sampling_params({"speculative": {"num_tokens": 17}, "top_p": 2.0})
    assert caught.value.field == "speculative.num_tokens"  # nested fields are built first
    with pytest.raises(InvalidRequestError, match="stop: must be a tuple of strings"):
        sampling_params({"stop": "abc"})
    with pytest.raises(InvalidRequestError, match="speculative: must be SpeculativeParams"):
        sampling_params({"speculative": 4})
    with pytest.raises(TypeError, match=r"unknown sampling field\(s\) \['temprature'\]"):
        sampling_params({"temprature": 0})
    with pytest.raises(TypeError, match=r"unknown speculative field\(s\) \['k'\]"):
        sampling_params({"speculative": {"k": 2}})
    with pytest.raises(TypeError, match=r"unknown sampling option\(s\) \['temprature'\]"):
        options_message(pb.SamplingOptions, {"temprature": 0})
    # protobuf's own words follow the field's name
    with pytest.raises(ValueError, match=r"^seed: .*-1"):
        options_message(pb.SamplingOptions, {"n": 2, "seed": -1})
    with pytest.raises(TypeError, match=r"^temperature: .*str"):
        options_message(pb.SamplingOptions, {"temperature": "hot"})


def test_names_limit_a_mapping_to_some_fields():
    # as a KV transfer sends what sampling a first token needs, and nothing else
    first_token = ("temperature", "top_k", "stop_token_ids", "ignore_eos", "logprobs")
    message = options_message(pb.SamplingOptions, SAMPLED, first_token)
    assert set(message_values(message)) == set(first_token)
    assert not message.HasField("n") and not message.stop
    values = message_values(options_message(pb.SamplingOptions, SAMPLED), first_token)
    assert sampling_params(values | {"max_tokens": 1, "seed": 5}) == SamplingParams(
        max_tokens=1, seed=5, temperature=0.5, top_k=40, stop_token_ids=(7, 9),
        ignore_eos=True, logprobs=3,
    )  # fmt: skip
    assert options_message(pb.SamplingOptions, {"n": 2, "top_k": 3}, ("n",)).n == 2


# ------------------------------------------------------------------ the doors agree
def test_http_and_grpc_take_the_same_names_to_the_same_params():
    values = {
        "temperature": 0.5, "top_p": 0.875, "top_k": 40, "min_p": 0.125, "seed": 11,
        "stop": ["END"], "stop_token_ids": [7], "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "repetition_penalty": 1.125, "ignore_eos": True,
        "min_tokens": 2, "n": 2, "best_of": 3, "skip_special_tokens": False,
    }  # fmt: skip
    http = parse_body(
        json.dumps({"prompt": "x", "logprobs": 2, **values}).encode(), CompletionRequest
    )
    grpc = generate_request("x", max_tokens=9, logprobs=2, **values)
    assert (
        http.sampling_for(9)
        == grpc_sampling_params(grpc.sampling)
        == sampling_params({**values, "max_tokens": 9, "logprobs": 2})
    )

    beams = {"beam_width": 3, "n": 2, "length_penalty": 0.5, "early_stopping": True}
    chat = {"messages": [{"role": "user", "content": "x"}], **beams}
    http = parse_body(json.dumps(chat).encode(), ChatCompletionRequest)
    grpc = generate_request("x", max_tokens=4, **beams)
    assert http.sampling_for(4) == grpc_sampling_params(grpc.sampling)

    spec = {"speculative": {"method": "draft", "num_tokens": 2}, "temperature": 0.0}
    http = parse_body(json.dumps({"prompt": "x", **spec}).encode(), CompletionRequest)
    grpc = generate_request("x", max_tokens=4, **spec)
    assert http.sampling_for(4) == grpc_sampling_params(grpc.sampling)


# ------------------------------------------------------------------ seeds
def test_a_forks_seed_is_the_requests_plus_its_index_wrapping_at_2_63():
    assert fork_seed(5, 0) == 5
    assert fork_seed(5, 3) == 8
    assert fork_seed(2**63 - 1, 1) == 0
    assert fork_seed(2**63 - 2, 4) == 2
