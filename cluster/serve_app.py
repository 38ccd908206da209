"""The OpenAI-compatible HTTP front end: a Ray Serve deployment with a FastAPI ingress.

This module is the HTTP door's deployment and routes: each route parses its OpenAI
body, checks it and starts its job. ``http_answers`` writes the answers (whole, or as
server-sent events), ``http_bodies`` reads the bodies, and ``http_app`` is the FastAPI
app the routes belong to. What both doors share (the checks, submitting a request,
merging its streams under its deadline, the metrics) is the replica's
``tessera.cluster.front_end.FrontEnd``; the gRPC door is ``tessera.cluster.grpc_api``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events ending in ``data: [DONE]``, or whole), ``POST /v1/responses``
(OpenAI's Responses API on the chat path, ``responses_answers``) with ``GET`` and
``DELETE /v1/responses/{id}``, ``POST /v1/embeddings`` (``openai_embeddings``),
``GET /v1/models`` and ``GET /v1/models/{model}`` (the base model and its LoRA
adapters), ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(``openai_loras``), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes),
``GET /health`` (503 while no worker is healthy) and ``GET /metrics`` (Prometheus).

**Self-bootstrapping.** A replica's constructor gets the cluster's scheduler by name,
or creates it (detached, so that it outlives the replica) when this app is the first
to run: ``tessera serve``, ``serve run tessera.cluster.serve_app:app_builder`` and KubeRay's
``serveConfigV2`` all start the same way. Replicas are thin (no CPU reserved): they
tokenize, place each request through the scheduler and relay the worker's stream.

**Errors** are OpenAI's error objects (``cluster.openai_errors.APIError``): 400
naming the field (an unknown one too, unless ``ignore_unknown_fields``: then it is
dropped and logged), 401 without the API key, 403 for a ``Host`` a keyless local server
does not answer to (``http_access``), 404 for an unknown model or route, 408 past the
request's deadline or a body slower than ``body_timeout_s``, 413 above the body limit,
415 for a body that is not JSON, 429 with ``Retry-After`` when the cluster is
overloaded, 503 when no worker is left or too many bodies are slow
(``max_pending_bodies``). ``/docs``, ``/openapi.json`` and ``/metrics`` need the key
too (``/metrics`` not with ``metrics_open``).

**Tracing.** With ``otlp_traces_endpoint`` every completion, chat and Responses request
is one OpenTelemetry trace, joined to the caller's by its ``traceparent`` header
(``tracing``; the replica exports it).

**The event loop stays free.** Tokenizing and chat templates run on a thread pool of
the machine's size; a text longer than any context could hold (``max_prompt_chars``)
is refused by its length before it is tokenized. A stream that fails after it began
ends with an error event and ``[DONE]``. A client that goes away aborts its request on
the worker, which frees its blocks at once.
"""

import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from ray import serve

from tessera.cluster import openai_embeddings, openai_loras
from tessera.cluster.front_end import FrontEnd
from tessera.cluster.grpc_access import check_message_limit
from tessera.cluster.grpc_api import GenerationService
from tessera.cluster.http_access import HttpAccess
from tessera.cluster.http_answers import AnswerWriter
from tessera.cluster.http_app import REPLICA_HEADER, api, replica_name
from tessera.cluster.http_bodies import BodyReader
from tessera.cluster.jobs import Job
from tessera.cluster.metrics import CONTENT_TYPE
from tessera.cluster.openai_chat import ChatCompletionRequest, TokenizeChatRequest
from tessera.cluster.openai_embeddings import EmbeddingRequest
from tessera.cluster.openai_errors import APIError, invalid
from tessera.cluster.openai_loras import LoadLoraRequest, UnloadLoraRequest
from tessera.cluster.openai_parsing import parse_body
from tessera.cluster.openai_requests import (
    Body,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeCompletionRequest,
)
from tessera.cluster.openai_responses_api import ResponsesRequest
from tessera.cluster.response_store import GcsKeyValue, ResponseStore
from tessera.cluster.responses_answers import ResponsesWriter
from tessera.cluster.serve_config import ServeConfig
from tessera.scheduler.api import WorkerStatus
from tessera.workers.api import LoraRef, SamplingParams

#: The default ``max_tokens`` of the completions API (OpenAI's).
COMPLETIONS_MAX_TOKENS = 16

__all__ = ["REPLICA_HEADER", "OpenAIServer", "app_builder", "build_app"]


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
        self.answers = AnswerWriter(self.front)
        store = ResponseStore(
            GcsKeyValue(),
            f"tessera/{config.namespace}/{config.scheduler_name}/responses/",
            config.response_store_size,
            config.response_store_ttl_s,
        )
        await self.front.off_loop(store.sweep)  # those of replicas gone
        self.responses = ResponsesWriter(self.front, self.answers, store)
        self.bodies = BodyReader(config)
        self.access = HttpAccess(config)
        self._api_key = self.access.api_key  # the gRPC door's check (GenerationService)
        if config.grpc_port is not None:
            check_message_limit(config.max_request_bytes)
        self.created = int(time.time())

    # ------------------------------------------------------------------ routes
    @api.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        self.access.check_host(request)
        stats = await self.front.stats()
        workers = stats.workers if stats is not None else ()
        healthy = sum(w.status is WorkerStatus.HEALTHY for w in workers)
        body = {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self.access.authorize_metrics(request)
        return Response(await self.front.render_metrics(), media_type=CONTENT_TYPE)

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        """The app's OpenAPI schema (behind the key when one is set)."""
        self._authorize(request)
        return JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        """Swagger UI over the schema, which the page holds (so that it needs no second
        request, which a browser would send without the key)."""
        self._authorize(request)
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{api.title} - Swagger UI",
            swagger_ui_parameters={"spec": api.openapi()},
        )

    def __del__(self) -> None:
        """Serve's graceful shutdown of this replica: its metrics leave the board."""
        front = getattr(self, "front", None)
        if front is not None:
            front.close()

    def _model_card(self, lora: LoraRef | None = None) -> dict[str, Any]:
        """The base model's card, or an adapter's (vLLM's: ``parent`` the base model,
        ``root`` its folder)."""
        card = {
            "id": self.front.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tessera",
            "root": self.front.model_name,
            "parent": None,
            "max_model_len": self.front.max_model_len,
        }
        if lora is not None:
            card.update(id=lora.name, root=lora.path, parent=self.front.model_name)
        return card

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        """The base model, then the LoRA adapters (by name)."""
        self._authorize(request)
        loras = sorted(await self.front.client.loras(), key=lambda lora: lora.name)
        cards = [self._model_card(), *(self._model_card(lora) for lora in loras)]
        return JSONResponse({"object": "list", "data": cards})

    @api.get("/v1/models/{model:path}")
    async def model(self, request: Request, model: str) -> JSONResponse:
        """OpenAI's retrieve: the served model's or an adapter's card; 404 naming it for
        any other."""
        self._authorize(request)
        return JSONResponse(self._model_card(await self.front.model_lora(model)))

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        """vLLM's route: serve the PEFT adapter in ``lora_path`` as ``lora_name``."""
        self._authorize(request)
        body = self._parse(await self.bodies.read(request), LoadLoraRequest)
        lora = await openai_loras.load(self.front, body)
        return JSONResponse(
            {"object": "lora_adapter", "lora_name": lora.name, "lora_path": lora.path}
        )

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        """vLLM's route: stop serving ``lora_name``; 404 if it is not served."""
        self._authorize(request)
        body = self._parse(await self.bodies.read(request), UnloadLoraRequest)
        await openai_loras.unload(self.front, body)
        return JSONResponse({"object": "lora_adapter", "lora_name": body.lora_name})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            self._authorize(request)
            body = self._parse(await self.bodies.read(request), CompletionRequest)
            lora = await self.front.model_lora(body.model)
            self.front.check_request(body.priority, body.cache_salt)
            prompts = [await self.front.token_ids(p, "prompt") for p in body.prompts()]
            max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_MAX_TOKENS
            for prompt in prompts:
                self.front.check_length(prompt, max_tokens, "max_tokens")
            sampling = body.sampling_for(max_tokens)
            await self.front.check_structured(sampling.structured, body.wire_name("structured"))
            self.front.check_token_ids(sampling)
            trace = self.front.trace_context(request.headers)
            job = self._job("completion", "cmpl", prompts, sampling, body, arrival, trace, lora)
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
            chunks = self.answers.completion_chunks(job, body, echo)
            return self.answers.sse(job, chunks, "completions")
        await self.front.collect(job, "completions")
        return JSONResponse(self.answers.completion(job, body, echo))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            self._authorize(request)
            body = self._parse(await self.bodies.read(request), ChatCompletionRequest)
            trace = self.front.trace_context(request.headers)
            job = await self._start_chat(body, arrival, "chatcmpl", trace)
        except APIError as error:
            self.front.refused("chat", error.status)
            raise
        if body.stream:
            return self.answers.sse(job, self.answers.chat_chunks(job, body), "chat")
        await self.front.collect(job, "chat")
        return JSONResponse(await self.answers.chat(job, body))

    @api.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        """OpenAI's Responses API, on the chat path (``openai_responses_api``)."""
        arrival = time.monotonic()
        try:
            self._authorize(request)
            body = self._parse(await self.bodies.read(request), ResponsesRequest)
            chat, conversation = await self.responses.chat_request(body)
            trace = self.front.trace_context(request.headers)
            job = await self._start_chat(chat, arrival, "resp", trace)
        except APIError as error:
            self.front.refused("responses", error.status)
            raise
        if body.stream:
            return self.responses.stream(job, body, chat, conversation)
        await self.front.collect(job, "responses")
        return JSONResponse(await self.responses.whole(job, body, chat, conversation))

    @api.get("/v1/responses/{response_id}")
    async def retrieve_response(self, request: Request, response_id: str) -> JSONResponse:
        """A stored response (``response_store``); 404 for any other."""
        self._authorize(request)
        return JSONResponse(await self.responses.retrieve(response_id))

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, request: Request, response_id: str) -> JSONResponse:
        self._authorize(request)
        return JSONResponse(await self.responses.delete(response_id))

    async def _start_chat(
        self,
        body: ChatCompletionRequest,
        arrival: float,
        prefix: str,
        trace: dict[str, str] | None,
    ) -> Job:
        """Check a chat request, render its conversation and start its job (the chat
        route's, and the Responses API's with the chat request it becomes); ``trace``:
        its trace context when this replica traces (``FrontEnd.trace_context``)."""
        lora = await self.front.model_lora(body.model)
        self.front.check_request(body.priority, body.cache_salt)
        await self.front.check_tools(body)
        prompt = await self.front.chat_prompt(body)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # as vLLM: the rest of the context (that the pool holds)
            width = body.beam_width or body.best_of or body.n
            limit = min(self.front.max_model_len, self.front.pool_tokens // max(width, 1))
            if len(prompt) >= limit:
                raise invalid(
                    body.wire_name("messages"),
                    f"the conversation is {len(prompt)} tokens, at or over the {limit} "
                    "tokens each output may hold here (the context length, or the KV "
                    f"pool shared by the outputs); set {body.wire_name('max_tokens')}",
                )
            max_tokens = limit - len(prompt)
        self.front.check_length(prompt, max_tokens, body.wire_name("max_tokens"))
        body._tool_format = self.front.tool_format
        sampling = body.sampling_for(max_tokens)
        await self.front.check_structured(sampling.structured, body.wire_name("structured"))
        sampling = await self.front.answer_only(sampling)
        self.front.check_token_ids(sampling)
        job = self._job("chat", prefix, [prompt], sampling, body, arrival, trace, lora)
        job.tool_names = frozenset(f["name"] for f in body.offered_tools())
        await self.front.start(job, body.priority, body.cache_salt)
        return job

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
            body = self._parse(await self.bodies.read(request), EmbeddingRequest)
            answer = await openai_embeddings.embeddings(self.front, body)
        except APIError as error:
            openai_embeddings.count(self.front, error.status)
            raise
        openai_embeddings.count(self.front, 200)
        return JSONResponse(answer)

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        """A prompt's or a conversation's token ids, as vLLM's ``/tokenize`` gives them."""
        self._authorize(request)
        raw = await self.bodies.read(request)
        try:  # the shape decides; _parse names a bad field
            chat = "messages" in json.loads(raw)
        except (ValueError, TypeError):
            chat = False
        body = self._parse(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
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
        body = self._parse(await self.bodies.read(request), DetokenizeRequest)
        self.front.check_model(body.model)
        ids = await self.front.token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": await self.front.off_loop(self.front.tokenizer.decode, ids)})

    # ------------------------------------------------------------------ checks
    def _authorize(self, request: Request) -> None:
        self.access.authorize(request)

    def _parse(self, raw: bytes, model: type[Body]) -> Any:
        """The body as ``model``, its unknown fields refused or (``ignore_unknown_fields``)
        dropped and logged."""
        return parse_body(raw, model, self.config.ignore_unknown_fields)

    def _job(
        self,
        kind: str,
        prefix: str,
        prompts: list[list[int]],
        sampling: SamplingParams,
        body: Any,
        arrival: float,
        trace: dict[str, str] | None,
        lora: LoraRef | None = None,
    ) -> Job:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        job = self.front.job(
            kind, request_id, prompts, sampling, arrival, body.timeout, body.include_usage, lora
        )
        job.trace = trace
        return job


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
