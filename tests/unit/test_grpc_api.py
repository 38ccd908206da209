"""The gRPC wire format alone (no Ray, no server): ``SamplingOptions`` to
``SamplingParams``, deltas to ``GenerateResponse``, errors to status codes, and the
client's request builder."""

from __future__ import annotations

import grpc
import pytest

from tessera.cluster.grpc_api import grpc_error, response, sampling_params
from tessera.cluster.grpc_client import generate_request
from tessera.cluster.openai_protocol import APIError
from tessera.protos.tessera.v1 import generation_pb2 as pb
from tessera.scheduler.api import DeadlineError, NoWorkerError, OverloadedError
from tessera.workers.api import (
    FinishReason,
    InvalidRequestError,
    ParallelSet,
    ParallelTokensParams,
    RequestOutput,
    SamplingParams,
    SpeculativeParams,
    SpeculativeStats,
    TokenLogprob,
)


def test_unset_options_take_the_sampling_defaults():
    assert sampling_params(pb.SamplingOptions()) == SamplingParams()


def test_set_options_map_one_to_one():
    options = pb.SamplingOptions(
        max_tokens=5, temperature=0.7, top_k=0, seed=2**62, stop=["a", "b"],
        stop_token_ids=[2], ignore_eos=True, logprobs=3, skip_special_tokens=False, n=2,
    )  # fmt: skip
    assert sampling_params(options) == SamplingParams(
        max_tokens=5, temperature=0.7, top_k=0, seed=2**62, stop=("a", "b"),
        stop_token_ids=(2,), ignore_eos=True, logprobs=3, skip_special_tokens=False, n=2,
    )  # fmt: skip


def test_a_bad_option_names_its_field_under_sampling():
    with pytest.raises(APIError) as caught:
        sampling_params(pb.SamplingOptions(top_p=1.5))
    assert caught.value.status == 400
    assert caught.value.message.startswith("sampling.top_p: ")


def test_speculative_and_parallel_tokens_round_trip_from_the_client():
    request = generate_request("hi", speculative={"method": "draft", "num_tokens": 6})
    assert sampling_params(request.sampling).speculative == SpeculativeParams("draft", 6)
    given = SpeculativeParams("ngram", 0, adaptive=False)
    assert sampling_params(generate_request("hi", speculative=given).sampling).speculative == given
    # an empty message: the engine's defaults
    assert sampling_params(generate_request("hi", speculative={}).sampling).speculative == (
        SpeculativeParams()
    )
    assert sampling_params(pb.SamplingOptions()).speculative is None

    request = generate_request(
        "hi", parallel_tokens={"threshold": 0.25, "max_width": 3, "mode": "visible"}
    )
    assert sampling_params(request.sampling).parallel_tokens == ParallelTokensParams(
        0.25, 3, "visible"
    )
    request = generate_request("hi", parallel_tokens=ParallelTokensParams(max_width=2))
    assert sampling_params(request.sampling).parallel_tokens == ParallelTokensParams(max_width=2)
    request = generate_request("hi", parallel_tokens={"max_width": 8})
    assert not request.sampling.parallel_tokens.HasField("threshold")
    assert sampling_params(request.sampling).parallel_tokens == ParallelTokensParams(max_width=8)
    assert sampling_params(pb.SamplingOptions()).parallel_tokens is None
    assert not generate_request("hi", speculative=None).sampling.HasField("speculative")

    with pytest.raises(TypeError, match=r"unknown speculative option\(s\) \['tokens'\]"):
        generate_request("hi", speculative={"tokens": 4})
    with pytest.raises(TypeError, match="parallel_tokens must be a dict"):
        generate_request("hi", parallel_tokens=0.1)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"speculative": {"num_tokens": 17}}, "sampling.speculative.num_tokens"),
        ({"speculative": {"method": "eagle"}}, "sampling.speculative.method"),
        ({"parallel_tokens": {"mode": "shared"}}, "sampling.parallel_tokens.mode"),
        ({"parallel_tokens": {"threshold": 0.0}}, "sampling.parallel_tokens.threshold"),
        ({"parallel_tokens": {"max_width": 0}}, "sampling.parallel_tokens.max_width"),
        ({"parallel_tokens": {}, "n": 2}, "sampling.parallel_tokens"),
    ],
)
def test_a_bad_multi_token_option_names_its_field(options, field):
    with pytest.raises(APIError) as caught:
        sampling_params(generate_request("hi", **options).sampling)
    assert caught.value.status == 400
    assert caught.value.param == field
    assert caught.value.message.startswith(f"{field}: ")
    assert caught.value.message.count(":") == 1  # the field is named once


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequestError("n", "must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT),
        (OverloadedError("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DeadlineError("too late"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (NoWorkerError("none left"), grpc.StatusCode.UNAVAILABLE),
        (APIError(401, "incorrect API key"), grpc.StatusCode.UNAUTHENTICATED),
        (APIError(404, "model: 'x' is not served here"), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_errors_map_to_status_codes_keeping_the_message(error, code):
    mapped = grpc_error(error)
    assert mapped.code is code
    assert str(error) in mapped.message


def test_unexpected_errors_show_clients_no_internals():
    """Their text (Ray's names actors, pids and nodes) goes to the log only."""
    from ray.exceptions import RayActorError

    internal = grpc_error(RuntimeError("boom at pid 4242"))
    assert internal.code is grpc.StatusCode.INTERNAL
    assert internal.message == "internal error (RuntimeError); the server's log has the details"
    lost = grpc_error(RayActorError(error_msg="actor 9f3e... (pid 4242) died"))
    assert lost.code is grpc.StatusCode.UNAVAILABLE
    assert lost.message == "a part of the cluster failed while serving the request; retry"


def test_a_finished_delta_carries_its_reason_stop_and_logprobs():
    delta = RequestOutput(
        "r", " Paris", (3, 4), (TokenLogprob(3, -0.5, ((3, -0.5), (9, -2.0))),), True,
        FinishReason.STOP, 5, 2, "\n", 1, -1.25,
    )  # fmt: skip
    message = response("r", delta)
    assert (message.version, message.request_id, message.index) == (1, "r", 1)
    assert (message.text, list(message.token_ids)) == (" Paris", [3, 4])
    assert message.finish_reason == pb.FINISH_REASON_STOP
    assert message.WhichOneof("stop_reason") == "stop_string" and message.stop_string == "\n"
    assert message.cumulative_logprob == -1.25
    assert [(t.token_id, t.logprob) for t in message.logprobs[0].top] == [(3, -0.5), (9, -2.0)]
    assert not message.HasField("usage")

    stopped_by_token = response("r", RequestOutput("r", "", (2,), None, True, FinishReason.STOP,
                                                   stop_reason=2))  # fmt: skip
    assert stopped_by_token.stop_token_id == 2
    running = response("r", RequestOutput("r", "x", (7,)))
    assert running.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert running.WhichOneof("stop_reason") is None


def test_the_client_builds_requests_and_refuses_unknown_options():
    request = generate_request([1, 2, 3], max_tokens=4, timeout=2.5, request_id="a")
    assert request.WhichOneof("prompt") == "token_ids" and list(request.token_ids.ids) == [1, 2, 3]
    assert (request.version, request.timeout_s, request.sampling.max_tokens) == (1, 2.5, 4)
    assert not generate_request("hi").HasField("timeout_s")
    with pytest.raises(TypeError, match=r"unknown sampling option\(s\) \['temprature'\]"):
        generate_request("hi", temprature=0)


def test_a_delta_carries_its_parallel_sets_and_speculative_stats():
    sets = (
        ParallelSet(7, (5, 9), ("a", "b"), (0.5, 0.25)),
        ParallelSet(8, (3,), (" c",), (0.75,)),
    )
    message = response("r", RequestOutput("r", "a c", (5, 9, 3), parallel_sets=sets))
    assert [
        (s.position, list(s.token_ids), list(s.tokens), list(s.probs))
        for s in message.parallel_sets
    ] == [(7, [5, 9], ["a", "b"], [0.5, 0.25]), (8, [3], [" c"], [0.75])]
    assert not message.HasField("speculative")

    stats = SpeculativeStats(proposed=8, accepted=5, steps=3, tokens=8)
    message = response("r", RequestOutput("r", "x", (1,), speculative=stats))
    got = message.speculative
    assert (got.proposed, got.accepted, got.steps, got.tokens) == (8, 5, 3, 8)
    assert not message.parallel_sets
    # a request that speculated nothing yet still says that it speculates
    assert response("r", RequestOutput("r", "", (), speculative=SpeculativeStats())).HasField(
        "speculative"
    )
