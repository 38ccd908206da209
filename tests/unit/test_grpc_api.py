"""The gRPC wire format alone (no Ray, no server): ``SamplingOptions`` to
``SamplingParams``, deltas to ``GenerateResponse``, errors to status codes, and the
client's request builder."""

from __future__ import annotations

import grpc
import pytest

from cluster.grpc_api import grpc_error, response, sampling_params
from cluster.grpc_client import generate_request
from cluster.openai_protocol import APIError
from protos.tessera.v1 import generation_pb2 as pb
from scheduler.api import DeadlineError, NoWorkerError, OverloadedError
from workers.api import (
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
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


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequestError("n", "must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT),
        (OverloadedError("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DeadlineError("too late"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (NoWorkerError("none left"), grpc.StatusCode.UNAVAILABLE),
        (APIError(401, "incorrect API key"), grpc.StatusCode.UNAUTHENTICATED),
        (APIError(404, "model: 'x' is not served here"), grpc.StatusCode.NOT_FOUND),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_map_to_status_codes_keeping_the_message(error, code):
    mapped = grpc_error(error)
    assert mapped.code is code
    assert str(error) in mapped.message


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
