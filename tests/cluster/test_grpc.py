"""The gRPC API as users meet it: `tessera serve --grpc-port` (Ray Serve's gRPC
ingress), called over real gRPC on 127.0.0.1 with the package's sync and async
clients and with raw stubs.

Outputs are compared with the in-process engine on the same weights; errors are
checked for their status code and the field their message names.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import grpc
import httpx
import pytest
import ray
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tessera.cluster.cli import main as cli_main
from tessera.cluster.grpc_client import AsyncGenerationClient, GenerationClient, generate_request
from tessera.protos.tessera.v1 import generation_pb2 as pb
from tessera.protos.tessera.v1 import generation_pb2_grpc
from tessera.workers.api import ParallelTokensParams, SamplingParams
from tests.cluster.serve_process import free_port, serve_process
from tests.helpers import run_engine, text_of, tokens_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "grpc-key-51c2"
MODEL = "smol-grpc"
NAMESPACE = "grpc-test"
PROMPT = "The capital of France is"
LONG = {"max_tokens": 2000, "ignore_eos": True}  # minutes of decoding: ended early


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    settings = (
        f"served_model_name: {MODEL}\n"
        "num_kv_blocks: 256\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
        "max_ongoing_requests: 8\n"
    )
    root = tmp_path_factory.mktemp("grpc")
    with serve_process(root, settings, API_KEY, NAMESPACE, grpc=True) as server:
        yield server


@pytest.fixture
def client(server):
    with GenerationClient(server.grpc_target, api_key=API_KEY) as client:
        yield client


def engine_output(make_engine, prompt, **sampling):
    engine = make_engine()
    engine.add_request("ref", prompt, SamplingParams(**sampling))
    deltas = run_engine(engine)["ref"]
    return text_of(deltas), tokens_of(deltas), deltas


@contextlib.contextmanager
def socket_listening():
    """A port that something else listens on, on every interface."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def _idle(server, timeout_s: float = 15) -> None:
    """Wait until the worker has no request and the scheduler no ongoing one."""
    scheduler = server.scheduler()
    deadline = time.monotonic() + timeout_s
    while True:
        state = ray.get(scheduler.stats.remote()).workers[0]
        if state.ongoing == 0 and state.load.requests == 0:
            return
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {state}"
        time.sleep(0.1)


# ------------------------------------------------------------------ outputs
def test_generate_streams_what_the_engine_gives(server, client, make_engine):
    text, ids, _ = engine_output(make_engine, PROMPT, max_tokens=12, temperature=0)
    deltas = list(client.generate(PROMPT, max_tokens=12, temperature=0, request_id="g1"))
    assert len(deltas) > 1  # streamed, not whole
    assert [t for d in deltas for t in d.token_ids] == ids
    assert "".join(d.text for d in deltas) == text
    assert all(d.request_id == "g1" and d.version == 1 for d in deltas)
    assert deltas[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(d.finish_reason == pb.FINISH_REASON_UNSPECIFIED for d in deltas[:-1])
    assert [d.HasField("usage") for d in deltas] == [False] * (len(deltas) - 1) + [True]
    prompt_tokens = len(client.tokenize(PROMPT))
    usage = deltas[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 12)
    assert usage.total_tokens == prompt_tokens + 12


def test_speculative_and_parallel_tokens_over_grpc(server, client, make_engine):
    _, ids, _ = engine_output(make_engine, PROMPT, max_tokens=12, temperature=0)
    spec = {"method": "ngram", "num_tokens": 3}
    deltas = list(client.generate(PROMPT, max_tokens=12, temperature=0, speculative=spec))
    assert [t for d in deltas for t in d.token_ids] == ids
    stats = deltas[-1].speculative
    assert deltas[-1].HasField("speculative") and stats.steps > 0
    assert stats.tokens == stats.accepted + stats.steps
    parallel = ParallelTokensParams(0.05, 3, "isolated")
    _, ids, ref = engine_output(
        make_engine, PROMPT, max_tokens=12, temperature=0, parallel_tokens=parallel
    )
    deltas = list(client.generate(PROMPT, max_tokens=12, temperature=0, parallel_tokens=parallel))
    assert [t for d in deltas for t in d.token_ids] == ids
    got = [(s.position, list(s.token_ids)) for d in deltas for s in d.parallel_sets]
    assert got == [(s.position, list(s.token_ids)) for d in ref for s in d.parallel_sets]
    error = _error(lambda: list(client.generate(PROMPT, parallel_tokens={"mode": "shared"})))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("sampling.parallel_tokens.mode: must be one of")


async def test_async_client_token_prompt_logprobs_and_stop(server, make_engine):
    prompt = make_engine().tokenizer(PROMPT).input_ids
    sampling = {"max_tokens": 10, "temperature": 0, "logprobs": 2}
    _, ids, ref = engine_output(make_engine, prompt, **sampling)
    async with AsyncGenerationClient(server.grpc_target, api_key=API_KEY) as client:
        deltas = [d async for d in client.generate(prompt, **sampling)]
        assert [t for d in deltas for t in d.token_ids] == ids
        got = [lp for d in deltas for lp in d.logprobs]
        want = [lp for d in ref for lp in d.logprobs]
        assert [g.token_id for g in got] == [w.token_id for w in want]
        # float32 log-softmax over 49k logits, batched differently: equal to ~1e-5
        assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
        assert all(len(g.top) == 2 for g in got)

        stop = "".join(d.text for d in deltas).split()[1]  # the text's second word
        stopped = [
            d async for d in client.generate(prompt, max_tokens=10, temperature=0, stop=[stop])
        ]
        assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP
        assert stopped[-1].stop_string == stop
        assert stop not in "".join(d.text for d in stopped)
        assert [m.id for m in await client.list_models()] == [MODEL]
        assert await client.health() == "SERVING"


def test_n_outputs_seeded_each_as_alone(client, make_engine):
    deltas = list(client.generate(PROMPT, max_tokens=6, temperature=0.8, seed=11, n=2))
    for index, seed in ((0, 11), (1, 12)):  # output i samples with seed + i
        _, ids, _ = engine_output(make_engine, PROMPT, max_tokens=6, temperature=0.8, seed=seed)
        assert [t for d in deltas if d.index == index for t in d.token_ids] == ids
    assert deltas[-1].usage.completion_tokens == 12
    assert sum(d.finish_reason != pb.FINISH_REASON_UNSPECIFIED for d in deltas) == 2


def test_list_models_and_tokenize(client, make_engine):
    (model,) = client.list_models()
    assert model.id == MODEL and model.max_model_len > 0 and model.vocab_size == 49152
    tokenizer = make_engine().tokenizer
    assert client.tokenize(PROMPT) == tokenizer(PROMPT).input_ids
    assert (
        client.tokenize(PROMPT, add_special_tokens=False)
        == tokenizer(PROMPT, add_special_tokens=False).input_ids
    )
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    ids = tokenizer(PROMPT).input_ids
    full = stub.Tokenize(
        pb.TokenizeRequest(text=PROMPT, add_special_tokens=True, return_token_strs=True),
        metadata=client.metadata,
    )
    assert (list(full.token_ids), full.count, full.max_model_len) == (ids, len(ids), 8192)
    assert list(full.token_strs) == tokenizer.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "Hi there"}]
    chat = stub.Tokenize(
        pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in messages]),
        metadata=client.metadata,
    )
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert list(chat.token_ids) == tokenizer(rendered, add_special_tokens=False).input_ids
    bad = _error(
        lambda: stub.Tokenize(
            pb.TokenizeRequest(messages=[pb.ChatMessage(role="robot", content="x")]),
            metadata=client.metadata,
        )
    )
    assert bad.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad.details().startswith("messages.0.role"), bad.details()


# ------------------------------------------------------------------ ending early
def test_abort_ends_the_stream_and_frees_the_blocks(server, client):
    stream = client.generate(PROMPT, request_id="to-abort", **LONG)
    first = next(stream)
    assert first.request_id == "to-abort"
    assert client.abort("to-abort") is True
    rest = list(stream)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(d.token_ids) for d in [first, *rest]) < 2000
    _idle(server)
    scheduler = server.scheduler()
    worker = ray.get(scheduler.worker_handle.remote("mixed-0"))
    stats = ray.get(worker.engine_stats.remote())
    assert stats.free_blocks == stats.total_blocks
    assert client.abort("to-abort") is False  # over: nothing left to abort


def test_request_ids_are_the_callers_own(server, client):
    """A request runs under an id scoped to its caller: the same id running twice is
    refused, Abort never reaches an HTTP request (whose id it may have seen), and a
    message larger than max_request_bytes is refused before it is read."""
    stream = client.generate(PROMPT, request_id="mine", **LONG)
    next(stream)
    error = _error(lambda: list(client.generate(PROMPT, request_id="mine", max_tokens=2)))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "request_id: another running request has this id"
    stream.close()

    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60
    ) as http:
        lines = http.iter_lines()
        http_id = json.loads(next(lines).removeprefix("data: "))["id"]
        assert client.abort(http_id) is False  # the HTTP stream goes on to its end
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    _idle(server)

    huge = generate_request("x" * (4 * 2**20 + 1), max_tokens=1)
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    error = _error(lambda: list(stub.Generate(huge, metadata=client.metadata, timeout=30)))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert [d.text for d in client.generate("Hi", max_tokens=2, temperature=0)]


def test_client_deadline_is_deadline_exceeded_and_aborts_the_request(server, client):
    started = time.monotonic()
    error = _error(lambda: list(client.generate(PROMPT, timeout=2.0, **LONG)))
    assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 10
    _idle(server)  # the worker stopped it too

    # The request's own deadline, without a gRPC deadline: the server ends it.
    request = generate_request(PROMPT, **LONG)
    request.timeout_s = 1.0
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    error = _error(lambda: list(stub.Generate(request, metadata=client.metadata)))
    assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.details() == "the request passed its deadline of 1 s and was aborted"
    _idle(server)


def test_closing_the_stream_early_aborts_the_request(server, client):
    stream = client.generate(PROMPT, **LONG)
    next(stream)
    stream.close()  # cancels the call
    _idle(server)


def test_overload_is_resource_exhausted(server, client):
    scheduler = server.scheduler()
    ray.get(scheduler.set_admission.remote(1, 0))  # one place, no queue
    try:
        stream = client.generate(PROMPT, **LONG)
        next(stream)
        error = _error(lambda: list(client.generate(PROMPT, max_tokens=2)))
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in error.details()
        stream.close()
    finally:
        ray.get(scheduler.set_admission.remote(8, 64))
    _idle(server)


# ------------------------------------------------------------------ errors
INVALID = [
    # (request fields, field named in the message)
    ({"sampling": {"temperature": -1.0}}, "sampling.temperature"),
    ({"sampling": {"top_p": 0.0}}, "sampling.top_p"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
    ({"sampling": {"max_tokens": 100_000}}, "sampling.max_tokens"),
    ({"sampling": {"beam_width": 2, "logprobs": 1}}, "sampling."),
    ({"prompt": None}, "prompt: must be set"),
    ({"prompt": ""}, "text: must not be empty"),
    ({"prompt": [10**8]}, "prompt: token id 100000000 is out of the vocabulary"),
    ({"version": 7}, "version: this server speaks version 1, got 7"),
    ({"timeout_s": -1.0}, "timeout_s: must be a number > 0"),
    ({"sampling": {"stop_token_ids": [10**6]}}, "sampling.stop_token_ids: token id 1000000"),
    ({"sampling": {"stop": ["a"] * 17}}, "sampling.stop: at most 16 stop strings, got 17"),
    ({"sampling": {"beam_width": 0}}, "sampling.beam_width: must be in [1, 64], got 0"),
    (
        {"sampling": {"structured": {"kind": "json", "spec": "{oops"}}},
        "sampling.structured.spec: is not a valid json",
    ),
    # bounded before any work (hostile input)
    ({"priority": 2**31 - 1}, "priority: must be in [-1000, 1000], got 2147483647"),
    ({"cache_salt": "s" * 1025}, "cache_salt: is 1025 characters, over the limit of 1024"),
    ({"request_id": "r" * 257}, "request_id: is 257 characters, over the limit of 256"),
    ({"sampling": {"stop": ["a" * 1025]}}, "sampling.stop: stop strings are at most 1024"),
    (
        {"sampling": {"structured": {"kind": "regex", "spec": "a" * (128 * 2**10 + 1)}}},
        "sampling.structured.spec: the grammar is 131073 bytes, over the limit of 131072",
    ),
]


@pytest.mark.parametrize(("fields", "named"), INVALID)
def test_invalid_arguments_name_the_field(client, fields, named):
    prompt = fields.pop("prompt", PROMPT)
    request = generate_request(prompt if prompt is not None else "x", **fields.pop("sampling", {}))
    if prompt is None:
        request.ClearField("text")
    for name, value in fields.items():
        setattr(request, name, value)
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    error = _error(lambda: list(stub.Generate(request, metadata=client.metadata, timeout=30)))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(named), error.details()  # the message, no traceback
    assert [d.text for d in client.generate("Hi", max_tokens=2, temperature=0)]  # still serves


def test_a_malformed_message_is_invalid_argument(client):
    """Bytes that are not a GenerateRequest: INVALID_ARGUMENT naming the message type
    (the proxy's parser would answer UNKNOWN), and the server goes on."""
    generate = client.channel.unary_stream(
        "/tessera.v1.Generation/Generate",
        request_serializer=lambda raw: raw,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    error = _error(lambda: list(generate(b"\xff\xff\xff", metadata=client.metadata, timeout=30)))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith("the request is not a valid tessera.v1.GenerateRequest")
    assert [d.text for d in client.generate("Hi", max_tokens=2, temperature=0)]


def test_unknown_model_is_not_found_and_unknown_option_a_type_error(client):
    error = _error(lambda: list(client.generate(PROMPT, model="gpt-9", max_tokens=2)))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert "'gpt-9' is not served here" in error.details()
    with pytest.raises(TypeError, match="unknown sampling option.*'temprature'"):
        list(client.generate(PROMPT, temprature=0))


def test_api_key_is_required_except_for_health(server):
    for key, words in ((None, "missing API key"), ("wrong", "incorrect API key")):
        with GenerationClient(server.grpc_target, api_key=key) as client:
            for call in (
                lambda c=client: list(c.generate(PROMPT, max_tokens=2)),
                lambda c=client: c.list_models(),
                lambda c=client: c.tokenize("x"),
                lambda c=client: c.abort("x"),
            ):
                error = _error(call)
                assert error.code() is grpc.StatusCode.UNAUTHENTICATED
                assert words in error.details()
            assert client.health() == "SERVING"


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = stub.ServerReflectionInfo(iter([request]), timeout=30)
    names = {s.name for s in answer.list_services_response.service}
    assert {"tessera.v1.Generation", "grpc.health.v1.Health"} <= names


def test_a_grpc_port_in_use_fails_at_start(capsys):
    with socket_listening() as port:
        argv = ["serve", "--port", str(free_port()), "--grpc-port", str(port)]
        assert cli_main(argv) == 2
    assert f"error: grpc_port: cannot listen on port {port}" in capsys.readouterr().err


# ------------------------------------------------------------------ health (last: it kills)
def test_health_is_not_serving_while_no_worker_is_healthy(server, client, make_engine):
    """Also: a stream cut by the kill resumes on the restarted worker with the same
    tokens. The server streams 4 tokens at a time, so the worker holds up to 3 of them
    when it dies; the resumed request recomputes from those delivered."""
    long = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
    _, ids, _ = engine_output(make_engine, PROMPT, **long)
    cut: list = []
    two_deltas = threading.Event()

    def stream() -> None:
        for delta in client.generate(PROMPT, timeout=240, **long):
            cut.append(delta)
            if len(cut) == 2:
                two_deltas.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert two_deltas.wait(60)
    assert client.health() == "SERVING"
    assert client.health("tessera.v1.Generation") == "SERVING"
    error = _error(lambda: client.health("no.such.Service"))
    assert error.code() is grpc.StatusCode.NOT_FOUND

    seen: list[str] = []
    watching = threading.Event()

    def watch() -> None:
        from grpc_health.v1 import health_pb2

        request = health_pb2.HealthCheckRequest()
        call = client.health_stub.Watch(request, timeout=120)
        for answer in call:
            seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
            watching.set()
            if seen[-2:] == ["NOT_SERVING", "SERVING"]:
                call.cancel()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert watching.wait(30)
    worker = ray.get(server.scheduler().worker_handle.remote("mixed-0"))
    assert cut[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED, "the kill must come mid-stream"
    ray.kill(worker, no_restart=False)  # Ray restarts it; until it reports, none is healthy
    deadline = time.monotonic() + 30
    while client.health() == "SERVING":
        assert time.monotonic() < deadline, "health never left SERVING"
        time.sleep(0.05)
    deadline = time.monotonic() + 180
    while client.health() != "SERVING":
        assert time.monotonic() < deadline, "the worker never came back"
        time.sleep(0.2)
    watcher.join(30)
    assert seen[0] == "SERVING" and seen[-2:] == ["NOT_SERVING", "SERVING"]
    streamer.join(240)
    assert not streamer.is_alive()
    assert [t for d in cut for t in d.token_ids] == ids
    assert [d.finish_reason for d in cut].count(pb.FINISH_REASON_LENGTH) == 1
