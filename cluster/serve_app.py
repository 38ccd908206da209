"""The OpenAI-compatible HTTP front end: a Ray Serve deployment with a FastAPI ingress.

This module is the HTTP door: it parses OpenAI's bodies and writes their answers and
server-sent events. What both doors share (the checks, submitting a request, merging
its streams under its deadline, the metrics) is the replica's
``tessera.cluster.front_end.FrontEnd``; the gRPC door is ``tessera.cluster.grpc_api``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events ending in ``data: [DONE]``, or whole), ``GET /v1/models`` and
``GET /v1/models/{model}``, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes),
``GET /health`` (503 while no worker is healthy) and ``GET /metrics`` (Prometheus).

**Self-bootstrapping.** A replica's constructor gets the cluster's scheduler by name,
or creates it (detached, so that it outlives the replica) when this app is the first
to run: ``tessera serve``, ``serve run tessera.cluster.serve_app:app_builder`` and KubeRay's
``serveConfigV2`` all start the same way. Replicas are thin (no CPU reserved): they
tokenize, place each request through the scheduler and relay the worker's stream.

**Errors** are OpenAI's error objects (``cluster.openai_protocol.APIError``): 400
naming the field, 401 without the API key, 404 for an unknown model or route, 408 past
the request's deadline or a body slower than ``body_timeout_s``, 413 above the body
limit, 429 with ``Retry-After`` when the cluster is overloaded, 503 when no worker is
left or too many bodies are slow (``max_pending_bodies``).

**The event loop stays free.** Tokenizing and chat templates run on a thread pool of
the machine's size; a text longer than any context could hold (``max_prompt_chars``)
is refused by its length before it is tokenized. A stream that fails after it began
ends with an error event and ``[DONE]``. A client that goes away aborts its request on
the worker, which frees its blocks at once.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from tessera.cluster import tools as tool_calls
from tessera.cluster.auth import expected_authorization, key_matches
from tessera.cluster.config import ServeConfig
from tessera.cluster.front_end import Choice, FrontEnd, Job
from tessera.cluster.grpc_api import GenerationService
from tessera.cluster.metrics import CONTENT_TYPE
from tessera.cluster.openai_protocol import (
    RETRY_AFTER_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LogprobFormatter,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    api_error,
    internal_error,
    invalid,
    parallel_sets,
    parse_body,
    speculative_stats,
    usage,
)
from tessera.scheduler.api import WorkerStatus
from tessera.workers.api import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

#: The default ``max_tokens`` of the completions API (OpenAI's).
COMPLETIONS_MAX_TOKENS = 16
#: Characters of a tool call's arguments per streamed delta.
TOOL_ARGUMENT_PIECE = 16
#: A request body not complete this long after its headers is a slow one (see ``_read``).
BODY_GRACE_S = 0.5
#: The response header that names the front-end replica that served the request.
REPLICA_HEADER = "x-tessera-replica"


def replica_name() -> str:
    """This Serve replica's id within its deployment ("local" outside a replica)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica (RayServeException)
        return "local"


class _ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that served it, so a
    client (an operator, a test) knows which replica held its stream."""

    def __init__(self, app) -> None:
        self.app = app
        self.header: tuple[bytes, bytes] | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.header is None:
            self.header = (REPLICA_HEADER.encode(), replica_name().encode())

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_named)


api = FastAPI(title="Tessera", summary="An OpenAI-compatible LLM server", docs_url="/docs")
api.add_middleware(_ReplicaHeader)


@api.exception_handler(APIError)
async def _render_api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@api.exception_handler(HTTPException)
async def _render_http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(
        APIError(error.status_code, message, type=kind).body(), status_code=error.status_code
    )


@api.exception_handler(Exception)
async def _render_internal_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path)
    return JSONResponse(internal_error(error).body(), status_code=500)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is over the limit of {limit} bytes (max_request_bytes)",
        code="request_too_large",
    )


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body; ``request.state.body_bytes`` counts what came so far."""
    chunks = []
    request.state.body_bytes = 0
    async for chunk in request.stream():
        request.state.body_bytes += len(chunk)
        if request.state.body_bytes > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _extras(choice: Choice, delta: RequestOutput | None = None) -> dict:
    """A choice's ``parallel_tokens`` and ``speculative`` fields, only where the
    request asked for them: a streamed ``delta``'s own sets, or (None) all of them."""
    out: dict = {}
    sets = choice.parallel_sets if delta is None else delta.parallel_sets
    if sets is not None:
        out["parallel_tokens"] = parallel_sets(sets)
    if choice.speculative is not None and (delta is None or delta.finished):
        out["speculative"] = speculative_stats(choice.speculative)
    return out


# Everything the class uses is defined above it: ``serve.ingress`` serializes the class
# when it is decorated, with the module's names as they are at that point.
@serve.deployment(name="tessera")
@serve.ingress(api)
class OpenAIServer(GenerationService):
    """One front-end replica; every replica shares the cluster's one scheduler. It
    serves the gRPC API too (``GenerationService``)."""

    async def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.front = await FrontEnd.connect(config, replica_name())
        self.logprobs = LogprobFormatter(self.front.tokenizer)
        self._api_key = expected_authorization(config.api_key)
        self._slow_bodies = 0
        self.created = int(time.time())

    # ------------------------------------------------------------------ routes
    @api.get("/health")
    async def health(self) -> JSONResponse:
        stats = await self.front.stats()
        workers = stats.workers if stats is not None else ()
        healthy = sum(w.status is WorkerStatus.HEALTHY for w in workers)
        body = {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        return Response(await self.front.render_metrics(), media_type=CONTENT_TYPE)

    def __del__(self) -> None:
        """Serve's graceful shutdown of this replica: its metrics leave the board."""
        front = getattr(self, "front", None)
        if front is not None:
            front.close()

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.front.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tessera",
            "max_model_len": self.front.max_model_len,
        }

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    @api.get("/v1/models/{model:path}")
    async def model(self, request: Request, model: str) -> JSONResponse:
        """OpenAI's retrieve: the served model's card; 404 naming it for any other."""
        self._authorize(request)
        self.front.check_model(model)
        return JSONResponse(self._model_card())

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            self._authorize(request)
            body = parse_body(await self._read(request), CompletionRequest)
            self.front.check_model(body.model)
            prompts = [await self.front.token_ids(p, "prompt") for p in body.prompts()]
            max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_MAX_TOKENS
            for prompt in prompts:
                self.front.check_length(prompt, max_tokens, "max_tokens")
            sampling = body.sampling_for(max_tokens)
            self.front.check_token_ids(sampling)
            job = self._job("completion", "cmpl", prompts, sampling, body, arrival)
            echo = [
                (text if isinstance(text, str) else self.front.tokenizer.decode(ids))
                if body.echo
                else ""
                for text, ids in zip(body.prompts(), prompts, strict=True)
            ]
            await self.front.start(job, body.priority, body.cache_salt)
        except APIError as error:
            self.front.refused("completions", error.status)
            raise
        if body.stream:
            return self._sse(job, self._completion_chunks(job, body, echo), "completions")
        await self.front.collect(job, "completions")
        choices = []
        for index in sorted(job.choices):
            choice = job.choices[index]
            k = index // body.n
            logprobs = None
            if body.logprobs is not None:
                logprobs = self._completion_logprobs(job, k, choice.logprobs, len(echo[k]), body)
            text = echo[k] + "".join(choice.text)
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    **_extras(choice),
                    **self._prompt_logprobs_field(job, k, body),
                }
            )
        return JSONResponse(
            {
                "id": job.request_id,
                "object": "text_completion",
                "created": job.created,
                "model": job.model,
                "choices": choices,
                "usage": usage(job.prompt_tokens, job.completion_tokens),
            }
        )

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            self._authorize(request)
            body = parse_body(await self._read(request), ChatCompletionRequest)
            self.front.check_model(body.model)
            prompt = await self.front.chat_prompt(body)
            max_tokens = body.requested_max_tokens
            if max_tokens is None:  # as vLLM: the rest of the context (that the pool holds)
                width = body.beam_width or body.best_of or body.n
                limit = min(self.front.max_model_len, self.front.pool_tokens // max(width, 1))
                if len(prompt) >= limit:
                    raise invalid(
                        "messages",
                        f"the conversation is {len(prompt)} tokens, at or over the {limit} "
                        "tokens each output may hold here (the context length, or the KV "
                        "pool shared by the outputs); set max_tokens",
                    )
                max_tokens = limit - len(prompt)
            field_name = (
                "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            )
            self.front.check_length(prompt, max_tokens, field_name)
            body._tool_format = self.front.tool_format
            sampling = body.sampling_for(max_tokens)
            self.front.check_token_ids(sampling)
            job = self._job("chat", "chatcmpl", [prompt], sampling, body, arrival)
            job.tool_names = frozenset(f["name"] for f in body.offered_tools())
            await self.front.start(job, body.priority, body.cache_salt)
        except APIError as error:
            self.front.refused("chat", error.status)
            raise
        if body.stream:
            return self._sse(job, self._chat_chunks(job, body), "chat")
        await self.front.collect(job, "chat")
        choices = []
        for index in sorted(job.choices):
            choice = job.choices[index]
            logprobs = None
            if body.logprobs:
                logprobs = {"content": self.logprobs.chat(choice.logprobs)}
            message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.text)}
            finish = choice.finish_reason
            if job.tool_names:
                content, calls = tool_calls.parse(
                    message["content"], self.front.tool_format, job.tool_names
                )
                if calls:
                    message = {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [call.message() for call in calls],
                    }
                    finish = "tool_calls"
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    **_extras(choice),
                    **self._prompt_logprobs_field(job, 0, body),
                }
            )
        return JSONResponse(
            {
                "id": job.request_id,
                "object": "chat.completion",
                "created": job.created,
                "model": job.model,
                "choices": choices,
                "usage": usage(job.prompt_tokens, job.completion_tokens),
            }
        )

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        """A prompt's or a conversation's token ids, as vLLM's ``/tokenize`` gives them."""
        self._authorize(request)
        raw = await self._read(request)
        try:  # the shape decides; parse_body names a bad field
            chat = "messages" in json.loads(raw)
        except (ValueError, TypeError):
            chat = False
        body = parse_body(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        self.front.check_model(body.model)
        if chat:
            ids = await self.front.chat_prompt(body, body.add_special_tokens)
        else:
            ids = await self.front.tokenize(body.prompt, "prompt", body.add_special_tokens)
        strs = self.front.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.front.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }  # fmt: skip
        )

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        """Token ids back to text, as vLLM's ``/detokenize`` gives it."""
        self._authorize(request)
        body = parse_body(await self._read(request), DetokenizeRequest)
        self.front.check_model(body.model)
        ids = await self.front.token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": await self.front.off_loop(self.front.tokenizer.decode, ids)})

    # ------------------------------------------------------------------ checks
    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        given = request.headers.get("authorization")
        if given is None:
            raise APIError(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if not key_matches(self._api_key, given):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    async def _read(self, request: Request) -> bytes:
        """The body, within ``max_request_bytes`` and ``body_timeout_s``.

        A body still incomplete after ``BODY_GRACE_S`` is slow: at most
        ``max_pending_bodies`` slow ones are read at once per replica, the next gets 503
        at once. Bodies that arrive with their headers (every ordinary client's) never
        count, so stalled uploads cannot crowd them out.
        """
        config = self.config
        limit = config.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        reading = asyncio.ensure_future(_read_body(request, limit))
        started = time.monotonic()
        try:
            done, _ = await asyncio.wait({reading}, timeout=BODY_GRACE_S)
            if done:
                return reading.result()
            if self._slow_bodies >= config.max_pending_bodies:
                raise APIError(
                    503,
                    f"{self._slow_bodies} requests are already slow to send their bodies to "
                    "this replica, its limit (max_pending_bodies); retry shortly",
                    type="overloaded_error",
                    code="overloaded",
                    # its body may still come: close rather than read it
                    headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
                )
            self._slow_bodies += 1
            try:
                remaining = config.body_timeout_s - (time.monotonic() - started)
                return await asyncio.wait_for(asyncio.shield(reading), max(remaining, 0))
            finally:
                self._slow_bodies -= 1
        except TimeoutError:
            expected = f" of {length}" if length else ""
            raise APIError(
                408,
                f"the request body did not arrive within {config.body_timeout_s:g} s "
                f"(body_timeout_s): {request.state.body_bytes}{expected} bytes came",
                code="timeout",
                headers={"Connection": "close"},
            ) from None
        finally:
            reading.cancel()

    def _job(
        self,
        kind: str,
        prefix: str,
        prompts: list[list[int]],
        sampling: SamplingParams,
        body: Any,
        arrival: float,
    ) -> Job:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        return self.front.job(
            kind, request_id, prompts, sampling, arrival, body.timeout, body.include_usage
        )

    # ------------------------------------------------------------------ streaming
    def _sse(self, job: Job, chunks: AsyncIterator[dict], endpoint: str) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            status = 499
            self.front.metrics.in_flight.inc()
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                status = 200
            except Exception as error:  # after the first byte: an error event, then [DONE]
                failure = api_error(error)
                status = failure.status
                yield b"data: " + orjson.dumps(failure.body()) + b"\n\n"
            finally:  # also when the client left (cancelled): its requests are aborted
                self.front.metrics.in_flight.dec()
                self.front.finished(job, endpoint, status)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _chunk(self, job: Job, choices: list[dict], usage_: dict | None = None) -> dict:
        obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
        chunk = {
            "id": job.request_id,
            "object": obj,
            "created": job.created,
            "model": job.model,
            "choices": choices,
        }
        if job.include_usage:
            chunk["usage"] = usage_
        return chunk

    async def _completion_chunks(
        self, job: Job, body: CompletionRequest, echo: list[str]
    ) -> AsyncIterator[dict]:
        async with contextlib.aclosing(self.front.events(job)) as events:
            async for k, delta in events:
                index = job.choice_index(k, delta)
                fresh = index not in job.choices
                choice = self.front.record(job, k, delta)
                text = delta.text
                if fresh and echo[k]:
                    text = echo[k] + text
                    choice.offset = len(echo[k])
                logprobs = None
                if body.logprobs is not None:
                    prompt_part = None
                    if fresh and body.echo and k in job.prompt_logprobs:
                        prompt_part, _ = self.logprobs.prompt(
                            job.prompts[k], job.prompt_logprobs[k]
                        )
                    logprobs, choice.offset = self.logprobs.completion(
                        delta.logprobs or (), choice.offset, prompt_part
                    )
                finish = choice.finish_reason if delta.finished else None
                entry = {"index": index, "text": text, "logprobs": logprobs}
                if fresh:
                    entry |= self._prompt_logprobs_field(job, k, body)
                entry["finish_reason"] = finish
                yield self._chunk(job, [entry | _extras(choice, delta)])
        if job.include_usage:
            yield self._chunk(job, [], usage(job.prompt_tokens, job.completion_tokens))

    async def _chat_chunks(self, job: Job, body: ChatCompletionRequest) -> AsyncIterator[dict]:
        async with contextlib.aclosing(self.front.events(job)) as events:
            async for k, delta in events:
                choice = self.front.record(job, k, delta)
                index = job.choice_index(k, delta)
                if not choice.started:  # the first chunk of a choice names its role
                    choice.started = True
                    role = {"role": "assistant", "content": ""}
                    yield self._chunk(
                        job,
                        [{"index": index, "delta": role, "logprobs": None, "finish_reason": None}],
                    )
                if job.tool_names:  # calls are known once the output is whole
                    if delta.finished:
                        for entry in self._tool_call_entries(job, index, choice):
                            yield self._chunk(job, [entry])
                    continue
                logprobs = None
                if body.logprobs:
                    logprobs = {"content": self.logprobs.chat(delta.logprobs or ())}
                content = {"content": delta.text} if delta.text else {}
                finish = choice.finish_reason if delta.finished else None
                entry = {
                    "index": index,
                    "delta": content,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
                yield self._chunk(job, [entry | _extras(choice, delta)])
        if job.include_usage:
            yield self._chunk(job, [], usage(job.prompt_tokens, job.completion_tokens))

    def _completion_logprobs(
        self, job: Job, k: int, logprobs: list, offset: int, body: CompletionRequest
    ) -> dict[str, list]:
        """A whole choice's ``logprobs``: the echoed prompt's (computed in the prefill)
        first, then the completion's."""
        if body.echo and k in job.prompt_logprobs:
            prompt_part, _ = self.logprobs.prompt(job.prompts[k], job.prompt_logprobs[k])
            return self.logprobs.completion(logprobs, offset, prompt_part)[0]
        return self.logprobs.completion(logprobs, offset)[0]

    def _prompt_logprobs_field(self, job: Job, k: int, body: Any) -> dict:
        """``prompt_logprobs`` (vLLM's extra) for a choice of prompt ``k``, if asked."""
        if body.prompt_logprobs is None or k not in job.prompt_logprobs:
            return {}
        return {"prompt_logprobs": self.logprobs.prompt_logprobs(job.prompt_logprobs[k])}

    def _tool_call_entries(self, job: Job, index: int, choice: Choice) -> list[dict]:
        """A finished choice of a chat with tools, as OpenAI streams it: each call's
        id and name, then its arguments in pieces; or the text, if it made no call."""
        text = "".join(choice.text)
        content, calls = tool_calls.parse(text, self.front.tool_format, job.tool_names)
        if not calls:
            entries = [{"content": text}] if text else []
            finish = choice.finish_reason
        else:
            entries = [{"content": content}] if content else []
            for i, call in enumerate(calls):
                first = call.message(i)
                first["function"] = {"name": call.name, "arguments": ""}
                entries.append({"tool_calls": [first]})
                for start in range(0, len(call.arguments), TOOL_ARGUMENT_PIECE):
                    piece = call.arguments[start : start + TOOL_ARGUMENT_PIECE]
                    entries.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
            finish = "tool_calls"
        out = [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            for delta in entries
        ]
        out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish})
        return out


def build_app(config: ServeConfig) -> serve.Application:
    """The Serve application for ``config``: replicas from its replica settings."""
    options: dict[str, Any] = {
        "max_ongoing_requests": config.replica_max_ongoing_requests,
        "ray_actor_options": {"num_cpus": 0},
        "graceful_shutdown_timeout_s": config.graceful_shutdown_s,
    }
    if config.min_replicas == config.max_replicas:
        options["num_replicas"] = config.min_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": config.min_replicas,
            "max_replicas": config.max_replicas,
            "target_ongoing_requests": config.replica_target_ongoing_requests,
        }
    return OpenAIServer.options(**options).bind(config)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For ``serve run tessera.cluster.serve_app:app_builder key=value ...`` and KubeRay's
    ``serveConfigV2`` (``import_path`` + ``args``): ``args`` are ``ServeConfig``'s
    fields."""
    return build_app(ServeConfig.create(**args))
