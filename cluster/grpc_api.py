"""The gRPC client API: ``tessera.v1.Generation`` and ``grpc.health.v1.Health``.

Both ride on Ray Serve's gRPC ingress (``grpc_options``): Serve's gRPC proxy routes
``/tessera.v1.Generation/Generate`` to the method ``Generate`` of the application's
ingress deployment, so ``GenerationService`` is mixed into the HTTP app's deployment
(``tessera.cluster.serve_app.OpenAIServer``); both doors are thin adapters around the
replica's ``tessera.cluster.front_end.FrontEnd``: one deployment, one scheduler
connection, one request path, two wire formats. Serve's proxy also serves
gRPC server reflection for the registered services.

Errors end the call with a status code and a message that names the field:
``INVALID_ARGUMENT``, ``UNAUTHENTICATED`` (metadata ``authorization: Bearer <key>``;
health is exempt), ``NOT_FOUND`` (model), ``RESOURCE_EXHAUSTED`` (overloaded),
``DEADLINE_EXCEEDED`` (the request's ``timeout_s``, the client's gRPC deadline as the
Python client sends it, or ``request_timeout_s``), ``UNAVAILABLE`` (no healthy worker).

Serve's gRPC proxy listens on every interface (it has no host setting): set an API
key wherever the port is reachable from outside the machine. Request ids are scoped to
their caller, and messages bounded by ``max_request_bytes``: ``grpc_access``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from tessera.cluster.auth import key_matches
from tessera.cluster.grpc_access import caller, check_request_id, scoped_id
from tessera.cluster.grpc_client import API_VERSION
from tessera.cluster.openai_chat import TokenizeChatRequest
from tessera.cluster.openai_errors import api_error, invalid
from tessera.cluster.openai_parsing import validate_body
from tessera.protos.tessera.v1 import generation_pb2 as pb
from tessera.protos.tessera.v1 import generation_pb2_grpc
from tessera.scheduler.api import WorkerStatus
from tessera.workers.api import FinishReason, InvalidRequestError, RequestOutput, SamplingParams
from tessera.workers.decoding import sampling_fields

logger = logging.getLogger(__name__)

#: The services the gRPC ingress serves: ``grpc_options.grpc_servicer_functions``.
SERVICER_FUNCTIONS = (
    "tessera.cluster.grpc_api.add_generation_servicer",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)
#: The service name health checks may ask about (besides "", the whole server).
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
#: How often ``Watch`` looks at the workers' health.
WATCH_INTERVAL_S = 1.0

#: An HTTP status of the shared error mapping -> its gRPC status code.
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


class Malformed:
    """What a request whose bytes are not a valid message parses to (picklable: Serve's
    proxy sends the parsed request to the replica); the methods answer it with
    ``INVALID_ARGUMENT`` instead of the proxy's ``UNKNOWN``."""

    def __init__(self, message_type: str, reason: str) -> None:
        self.message_type, self.reason = message_type, reason


def _lenient(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    if parse is None:
        return handler
    message_type = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    name = message_type.full_name if message_type is not None else "request"

    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except Exception as error:  # protobuf's DecodeError, or anything a parser raises
            return Malformed(name, str(error) or type(error).__name__)

    return handler._replace(request_deserializer=deserialize)


class _LenientRegistration:
    """The server as the generated registration sees it: each method's request parser
    replaced by a lenient one (``Malformed`` instead of an exception)."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        for handler in handlers:  # grpc's own generic handler keeps them in this dict
            methods = handler._method_handlers
            handler._method_handlers = {name: _lenient(h) for name, h in methods.items()}
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        lenient = {name: _lenient(handler) for name, handler in handlers.items()}
        self._server.add_registered_method_handlers(service, lenient)


def add_generation_servicer(servicer, server: grpc.Server) -> None:
    """``tessera.v1.Generation``'s generated registration, with lenient parsers (the
    servicer function named in ``grpc_options``)."""
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, _LenientRegistration(server))


class GrpcError(Exception):
    """Ends a call with ``code``; Serve's proxy sends the code set on the context."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)  # both in args: Ray pickles it to the proxy
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


def grpc_error(error: BaseException) -> GrpcError:
    """The gRPC status for whatever ended a call (the HTTP app's mapping, translated)."""
    if isinstance(error, GrpcError):
        return error
    failure = api_error(error)
    return GrpcError(_CODES.get(failure.status, grpc.StatusCode.INTERNAL), failure.message)


def sampling_params(options: pb.SamplingOptions) -> SamplingParams:
    """``SamplingOptions`` -> ``SamplingParams``; unset fields take its defaults."""
    try:
        return sampling_fields.sampling_params(sampling_fields.message_values(options))
    except InvalidRequestError as error:
        raise invalid(f"sampling.{error.field}", error.message) from None


def response(request_id: str, delta: RequestOutput) -> pb.GenerateResponse:
    """One delta of one output as a ``GenerateResponse`` (without usage)."""
    message = pb.GenerateResponse(
        version=API_VERSION,
        request_id=request_id,
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=_FINISH[delta.finish_reason if delta.finished else None],
    )
    for logprob in (delta.prompt_logprobs or ())[1:]:  # the first prompt token has none
        message.prompt_logprobs.add(
            token_id=logprob.token_id,
            logprob=logprob.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top],
        )
    for logprob in delta.logprobs or ():
        message.logprobs.add(
            token_id=logprob.token_id,
            logprob=logprob.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top],
        )
    if isinstance(delta.stop_reason, str):
        message.stop_string = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        message.stop_token_id = delta.stop_reason
    if delta.cumulative_logprob is not None:
        message.cumulative_logprob = delta.cumulative_logprob
    for parallel in delta.parallel_sets or ():
        message.parallel_sets.add(
            position=parallel.position,
            token_ids=parallel.token_ids,
            tokens=parallel.tokens,
            probs=parallel.probs,
        )
    if delta.speculative is not None:
        stats = delta.speculative
        message.speculative.SetInParent()  # present even when every count is 0
        message.speculative.proposed = stats.proposed
        message.speculative.accepted = stats.accepted
        message.speculative.steps = stats.steps
        message.speculative.tokens = stats.tokens
    return message


def _check_message(request: object) -> None:
    """A request that parsed, in a version this server speaks."""
    if isinstance(request, Malformed):
        raise invalid(
            None, f"the request is not a valid {request.message_type} message: {request.reason}"
        )
    version = request.version
    if version not in (0, API_VERSION):
        raise invalid("version", f"this server speaks version {API_VERSION}, got {version}")


class GenerationService:
    """The gRPC door: the methods of the front-end deployment that Serve's gRPC proxy
    calls (a mixin of ``OpenAIServer``: Serve routes gRPC to methods of the ingress
    deployment), each a thin adapter around the replica's ``FrontEnd`` (``self.front``)
    that parses messages and writes answers. Each method takes the request message and
    Serve's ``grpc_context``."""

    async def Generate(  # noqa: N802 (the RPC's name)
        self, request: pb.GenerateRequest, grpc_context
    ) -> AsyncIterator[pb.GenerateResponse]:
        front = self.front
        arrival = time.monotonic()
        status, job = 200, None
        try:
            self._grpc_authorize(grpc_context)
            _check_message(request)
            lora = await front.model_lora(request.model or None)
            front.check_request(request.priority, request.cache_salt or None)
            prompt, sampling = await self._grpc_prompt(request)
            timeout = None
            if request.HasField("timeout_s"):
                if not (request.timeout_s > 0 and math.isfinite(request.timeout_s)):
                    raise invalid("timeout_s", f"must be a number > 0, got {request.timeout_s}")
                timeout = request.timeout_s
            check_request_id(request.request_id, allow_empty=True)
            request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
            cluster_id = scoped_id(caller(grpc_context), request_id)
            job = front.job("generate", cluster_id, [prompt], sampling, arrival, timeout, lora=lora)
            job.trace = front.trace_context(grpc_context.invocation_metadata())
            await front.start(job, request.priority, request.cache_salt or None)
            finished = 0
            async with contextlib.aclosing(front.events(job)) as events:
                async for k, delta in events:
                    front.record(job, k, delta)
                    message = response(request_id, delta)
                    finished += delta.finished
                    if finished == sampling.n:
                        message.usage.prompt_tokens = job.prompt_tokens
                        message.usage.completion_tokens = job.completion_tokens
                        message.usage.total_tokens = job.prompt_tokens + job.completion_tokens
                    yield message
        except (Exception, asyncio.CancelledError) as error:
            if isinstance(error, asyncio.CancelledError):  # the client left: abort
                status = 499
                raise
            failure = grpc_error(error)
            status = _http_status(failure.code)
            raise self._grpc_fail(grpc_context, failure) from None
        finally:
            if job is not None:
                front.finished(job, "grpc_generate", status)
            else:
                front.refused("grpc_generate", status)

    async def Abort(self, request: pb.AbortRequest, grpc_context) -> pb.AbortResponse:  # noqa: N802
        try:
            self._grpc_authorize(grpc_context)
            _check_message(request)
            check_request_id(request.request_id)
            scoped = scoped_id(caller(grpc_context), request.request_id)
            aborted = await self.front.client.abort(scoped)
        except Exception as error:
            raise self._grpc_fail(grpc_context, grpc_error(error)) from None
        return pb.AbortResponse(version=API_VERSION, aborted=aborted)

    async def ListModels(  # noqa: N802
        self, request: pb.ListModelsRequest, grpc_context
    ) -> pb.ListModelsResponse:
        try:
            self._grpc_authorize(grpc_context)
            _check_message(request)
        except Exception as error:
            raise self._grpc_fail(grpc_context, grpc_error(error)) from None
        front = self.front
        model = pb.Model(
            id=front.model_name, max_model_len=front.max_model_len, vocab_size=front.vocab_size
        )
        return pb.ListModelsResponse(version=API_VERSION, models=[model])

    async def Tokenize(  # noqa: N802
        self, request: pb.TokenizeRequest, grpc_context
    ) -> pb.TokenizeResponse:
        """A text's token ids, or a conversation's through the chat template (the
        HTTP ``/tokenize``'s fields)."""
        try:
            self._grpc_authorize(grpc_context)
            _check_message(request)
            self.front.check_model(request.model or None)
            if request.messages:
                messages = [{"role": m.role, "content": m.content} for m in request.messages]
                given = {"messages": messages}
                if request.HasField("add_generation_prompt"):
                    given["add_generation_prompt"] = request.add_generation_prompt
                conversation = validate_body(given, TokenizeChatRequest)
                ids = await self.front.chat_prompt(conversation, request.add_special_tokens)
            else:
                ids = await self.front.tokenize(request.text, "text", request.add_special_tokens)
        except Exception as error:
            raise self._grpc_fail(grpc_context, grpc_error(error)) from None
        tokenizer = self.front.tokenizer
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else ()
        return pb.TokenizeResponse(
            version=API_VERSION,
            token_ids=ids,
            count=len(ids),
            max_model_len=self.front.max_model_len,
            token_strs=strs,
        )

    # ------------------------------------------------------------------ health
    async def Check(  # noqa: N802 (grpc.health.v1.Health)
        self, request: health_pb2.HealthCheckRequest, grpc_context
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", SERVICE_NAME):
            failure = GrpcError(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
            raise self._grpc_fail(grpc_context, failure)
        return health_pb2.HealthCheckResponse(status=await self._serving())

    async def Watch(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, grpc_context
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """Sends the status now and again at each change, until the client leaves."""
        if request.service not in ("", SERVICE_NAME):
            unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            yield health_pb2.HealthCheckResponse(status=unknown)
            return
        last = None
        while True:
            status = await self._serving()
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _serving(self) -> int:
        stats = await self.front.stats()
        workers = stats.workers if stats is not None else ()
        if any(w.status is WorkerStatus.HEALTHY for w in workers):
            return health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse.NOT_SERVING

    # ------------------------------------------------------------------ checks and prompts
    def _grpc_authorize(self, grpc_context) -> None:
        if self._api_key is None:
            return
        metadata = dict(grpc_context.invocation_metadata())
        given = metadata.get("authorization")
        if given is None:
            raise GrpcError(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing API key: send the metadata 'authorization: Bearer <key>'",
            )
        if not key_matches(self._api_key, given):
            raise GrpcError(grpc.StatusCode.UNAUTHENTICATED, "incorrect API key")

    async def _grpc_prompt(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise invalid("prompt", "must be set: text or token_ids")
        if kind == "text":
            if not request.text:
                raise invalid("text", "must not be empty")
            prompt = await self.front.token_ids(request.text, "text")
        else:
            if not request.token_ids.ids:
                raise invalid("token_ids", "must not be empty")
            prompt = await self.front.token_ids(list(request.token_ids.ids), "prompt")
        sampling = sampling_params(request.sampling)
        self.front.check_token_ids(sampling, "sampling.")
        await self.front.check_structured(sampling.structured, "sampling.structured.spec")
        self.front.check_length(prompt, sampling.max_tokens, "sampling.max_tokens")
        return prompt, sampling

    @staticmethod
    def _grpc_fail(grpc_context, failure: GrpcError) -> GrpcError:
        """Set the call's status (Serve's proxy sends it) and return the error to raise."""
        grpc_context.set_code(failure.code)
        grpc_context.set_details(failure.message)
        return failure


def _http_status(code: grpc.StatusCode) -> int:
    """The metrics' status label of a gRPC outcome (the HTTP app's numbers; 500 for
    one that none maps to)."""
    return next((status for status, mapped in _CODES.items() if mapped is code), 500)
