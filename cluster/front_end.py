"""The front end's core, shared by its two doors: HTTP (``serve_app``) and gRPC
(``grpc_api``).

One ``FrontEnd`` per Serve replica holds the cluster connection (``ClusterClient``),
the model's limits, a thread pool that tokenizes off the event loop, and the request
metrics. Every request passes its checks here once (model, text size, token ids,
context length, grammars, priority, salt); the worker trusts them and guards only its
own entry. A request's generation is a ``Job``: ``start`` submits its prompts,
``events`` merges their streams until the job's deadline, ``record`` keeps what each
choice produced, and ``finished`` records the request's metrics. The doors only parse
their wire format, call these, and write their answers.

Nothing a request sends may stall the replica's event loop: each step whose cost grows
with the request is bounded by a size checked before it (text by ``max_prompt_chars``
before tokenizing, token ids by the context before their range, a grammar by
``max_grammar_bytes`` before compiling, ``cache_salt`` by ``MAX_CACHE_SALT_CHARS``),
and runs on the thread pool where it can take more than a millisecond (tokenizing, chat
templates, compiling grammars, parsing long answers for tool calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tessera.cluster import tools as tool_calls
from tessera.cluster import tracing
from tessera.cluster.config import ServeConfig
from tessera.cluster.jobs import Choice, Job, close_streams, deadline_error, invalid_as
from tessera.cluster.launch import Cluster
from tessera.cluster.metrics import Metrics
from tessera.cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    TokenizeChatRequest,
    api_error,
    finish_reason,
    invalid,
    max_prompt_chars,
)
from tessera.cluster.reasoning import REASONING_FORMATS, answer_grammar
from tessera.cluster.replica_board import ReplicaBoard
from tessera.scheduler.api import ClusterStats, DeadlineError
from tessera.workers import validation
from tessera.workers.api import (
    InvalidRequestError,
    LoraRef,
    RequestOutput,
    SamplingParams,
    StructuredParams,
    check_priority,
)
from tessera.workers.decoding import structured

logger = logging.getLogger(__name__)

#: Seconds between a replica's publications of its request metrics (``ReplicaBoard``).
METRICS_PUBLISH_S = 2.0
#: The longest ``cache_salt`` (vLLM has no limit). A salt joins the hash of every block
#: of its prompt, so the front end hands the cluster its SHA-256 instead (hashed once
#: per request, the same for every replica): a block's hash costs the same whatever
#: the salt.
MAX_CACHE_SALT_CHARS = 1024


def salt_key(cache_salt: str) -> str:
    """What the cluster hashes blocks with for ``cache_salt``: its SHA-256, in hex."""
    return hashlib.sha256(cache_salt.encode()).hexdigest()


class FrontEnd:
    """One replica's connection to the cluster and everything both doors share. Use
    ``await FrontEnd.connect(config, replica)``."""

    def __init__(self, config: ServeConfig, cluster: Cluster, info, replica: str) -> None:
        self.config = config
        self.cluster = cluster
        self.client = cluster.client
        self.tokenizer = self.client.tokenizer
        self.model_name = config.model_name
        self.max_model_len: int = info.max_model_len
        self.vocab_size: int = info.vocab_size
        self.hidden_size: int | None = info.hidden_size  # an embedding's dimensions
        self.pool_tokens: int = info.total_blocks * info.block_size  # one worker's KV pool
        self.metrics = Metrics(replica, self.model_name, self.max_model_len)
        self.board = ReplicaBoard(
            f"tessera/{config.namespace}/{config.scheduler_name}/front-end-metrics/", replica
        )
        # Tokenizing (and chat templates) run here, off the event loop, so that one
        # large prompt does not stall every other stream and /health.
        self._cpu = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tessera-cpu")
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        self.tool_format = tool_calls.tool_format(self.tokenizer.chat_template)
        self.template_takes_tools = tool_calls.template_takes_tools(self.tokenizer.chat_template)
        #: How the model marks its reasoning (``--reasoning-parser``); None: not split.
        self.reasoning = REASONING_FORMATS.get(config.reasoning_parser)
        # its tags that are tokens of their own (a grammar names them as tokens)
        tags = (self.reasoning.start, self.reasoning.end) if self.reasoning else ()
        added = self.tokenizer.get_added_vocab() if tags else {}
        self.special_tags = frozenset(tag for tag in tags if tag in added)
        #: Request tracing (``otlp_traces_endpoint``); None: off.
        self.tracer = None
        if config.otlp_traces_endpoint is not None:
            self.tracer = tracing.Tracer(config.otlp_traces_endpoint)
        self._publisher = asyncio.get_running_loop().create_task(self._publish_metrics())

    @classmethod
    async def connect(cls, config: ServeConfig, replica: str) -> FrontEnd:
        """Connect to the cluster (starting it, detached, if this is the first replica)."""
        cluster = await Cluster.start(config.cluster_config(), detached=True)
        info = await cluster.scheduler.model_info.remote()
        return cls(config, cluster, info, replica)

    # ------------------------------------------------------------------ cluster
    async def stats(self) -> ClusterStats | None:
        """The cluster's stats; None when the scheduler does not answer."""
        try:
            return await self.client.stats()
        except Exception as error:  # the scheduler is gone or restarting
            logger.warning("no stats from the scheduler: %s", error)
            return None

    async def render_metrics(self) -> str:
        """/metrics: this replica's and the other live replicas' request series."""
        others = await self.off_loop(self.board.read)
        return self.metrics.render(await self.stats(), others)

    async def _publish_metrics(self) -> None:
        """Publish this replica's request metrics for the others' /metrics whenever
        they changed, every ``METRICS_PUBLISH_S``."""
        last = b""
        while True:
            snapshot = self.metrics.snapshot()
            if snapshot != last:
                try:
                    await self.off_loop(self.board.publish, snapshot)
                    last = snapshot
                except Exception as error:  # the GCS is briefly away: try again later
                    logger.warning("could not publish the request metrics: %s", error)
            await asyncio.sleep(METRICS_PUBLISH_S)

    def close(self) -> None:
        """The replica is going: its metrics leave the board."""
        self._publisher.cancel()
        with contextlib.suppress(Exception):  # Ray may be going down with it
            self.board.withdraw()
        if self.tracer is not None:
            self.tracer.close()  # the spans still batched go out first

    def trace_context(
        self, headers: Mapping[str, str] | Iterable[tuple[str, str]]
    ) -> dict[str, str] | None:
        """A job's ``trace`` from its request's headers (or gRPC metadata): the W3C
        trace context it brought; None when this replica does not trace."""
        return None if self.tracer is None else tracing.trace_headers(headers)

    # ------------------------------------------------------------------ checks
    async def off_loop(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run CPU work (tokenizing, chat templates) on the replica's thread pool."""
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._cpu, call)

    def check_model(self, model: str | None) -> None:
        """``model`` is the base model's name (or not given): routes that serve no
        adapter."""
        if model is not None and model != self.model_name:
            raise self._not_served(model)

    async def model_lora(self, model: str | None) -> LoraRef | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); a 404
        for a name that is neither."""
        if model is None or model == self.model_name:
            return None
        lora = await self.client.lora(model)
        if lora is None:
            raise self._not_served(model)
        return lora

    def _not_served(self, model: str) -> APIError:
        return APIError(
            404,
            f"model: {model!r} is not served here; this server serves {self.model_name!r}",
            param="model",
            code="model_not_found",
        )

    def check_size(self, chars: int, field_name: str) -> None:
        """Refuse text that is certainly over the context before tokenizing it."""
        if chars > self.max_prompt_chars:
            raise invalid(
                field_name,
                f"the text is {chars} characters, more than any {self.max_model_len}-token "
                f"context holds ({self.max_prompt_chars} characters at most, from the "
                "vocabulary's longest token)",
            )

    async def tokenize(
        self, text: str, field_name: str, add_special_tokens: bool = True
    ) -> list[int]:
        """``text``'s token ids, off the event loop, once its length could fit."""
        self.check_size(len(text), field_name)
        encoded = await self.off_loop(self.tokenizer, text, add_special_tokens=add_special_tokens)
        return encoded.input_ids

    async def token_ids(self, prompt: str | list[int], field_name: str) -> list[int]:
        """A prompt's token ids: text tokenized, or ids checked against the context
        (their count, first) and the vocabulary."""
        if isinstance(prompt, str):
            return await self.tokenize(prompt, field_name)
        with invalid_as(""):
            validation.check_prompt_ids(prompt, self.vocab_size, field_name, self.max_model_len)
        return prompt

    def check_request(self, priority: int, cache_salt: str | None, prefix: str = "") -> None:
        """A request's ``priority`` and ``cache_salt``, checked before any work on it
        (``prefix``: gRPC's field path)."""
        with invalid_as(prefix):
            check_priority(priority)
        if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise invalid(
                f"{prefix}cache_salt",
                f"is {len(cache_salt)} characters, over the limit of {MAX_CACHE_SALT_CHARS}",
            )

    async def check_structured(
        self, params: StructuredParams | None, field_name: str, what: str | None = None
    ) -> None:
        """A structured output's grammar: within ``max_grammar_bytes`` (checked first),
        then compiled on the thread pool. A grammar is compiled once per process:
        compiled ones and refusals alike are cached (``structured.check``). ``what``
        names the kind in the error (a tool's "schema", not "json")."""
        if params is None:
            return
        spec = params.spec
        size = len(spec) if spec.isascii() else len(spec.encode())
        limit = self.config.max_grammar_bytes
        if size > limit:
            raise invalid(
                field_name,
                f"the grammar is {size} bytes, over the limit of {limit} bytes (max_grammar_bytes)",
            )
        try:
            await self.off_loop(structured.check, params)
        except InvalidRequestError as error:
            message = error.message
            if what is not None:
                message = message.replace(f"is not a valid {params.kind}", f"is not a valid {what}")
            raise invalid(field_name, message) from None

    async def check_tools(self, body: ChatCompletionRequest) -> None:
        """Each offered function's ``parameters`` is a JSON schema (``check_structured``)."""
        for field_name, params in body.tool_schemas():
            await self.check_structured(params, field_name, "schema")

    async def chat_prompt(
        self, body: ChatCompletionRequest | TokenizeChatRequest, add_special_tokens: bool = False
    ) -> list[int]:
        """A conversation's token ids through the model's chat template (with the
        offered tools: the template's own way, or our tool prompt)."""
        if not self.tokenizer.chat_template:
            raise invalid("messages", "this model has no chat template; use /v1/completions")
        if body.continue_final_message and body.add_generation_prompt:
            raise invalid(
                "continue_final_message", "needs add_generation_prompt to be false as well"
            )
        conversation = body.conversation(self.template_takes_tools)
        self.check_size(sum(len(m["content"]) for m in conversation), "messages")
        offered = body.offered_tools() if isinstance(body, ChatCompletionRequest) else []
        extra: dict[str, Any] = body.template_kwargs()
        if offered and self.template_takes_tools:
            extra["tools"] = [{"type": "function", "function": f} for f in offered]
        elif offered:  # our own tool prompt, in the system message
            prompt = tool_calls.tool_prompt(offered)
            if conversation[0]["role"] == "system":
                conversation[0]["content"] += "\n\n" + prompt
            else:
                conversation.insert(0, {"role": "system", "content": prompt})
        try:
            text = await self.off_loop(
                self.tokenizer.apply_chat_template,
                conversation,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tokenize=False,
                **extra,
            )
        except Exception as error:  # the template refuses the conversation
            raise invalid("messages", f"the chat template refused them: {error}") from None
        # The template wrote the special tokens (BOS) already.
        encoded = await self.off_loop(self.tokenizer, text, add_special_tokens=add_special_tokens)
        return encoded.input_ids

    async def answer_only(self, sampling: SamplingParams) -> SamplingParams:
        """With a reasoning parser, the request's structured output (or forced tool
        calls) holds the answer only: the reasoning before it runs free. The answer's
        grammar is built and compiled on the thread pool."""
        if self.reasoning is None or sampling.structured is None:
            return sampling

        def answer() -> StructuredParams:
            grammar = answer_grammar(self.reasoning, sampling.structured, self.special_tags)
            structured.check(grammar)
            return grammar

        with invalid_as(""):
            grammar = await self.off_loop(answer)
        return dataclasses.replace(sampling, structured=grammar)

    def check_token_ids(self, sampling: SamplingParams, prefix: str = "") -> None:
        """The request's stop token ids and logit-bias ids are in the vocabulary: checked
        here, before placing it, so that each door names its own field (``prefix``:
        gRPC's ``sampling.``)."""
        with invalid_as(prefix):
            validation.check_sampling_ids(sampling, self.vocab_size)

    def check_length(self, prompt: Sequence[int], max_tokens: int, field_name: str) -> None:
        if isinstance(max_tokens, int):
            with invalid_as(""):
                validation.check_context(len(prompt), max_tokens, self.max_model_len, field_name)

    # ------------------------------------------------------------------ generation
    def job(
        self,
        kind: str,
        request_id: str,
        prompts: list[list[int]],
        sampling: SamplingParams,
        arrival: float,
        timeout_s: float | None = None,
        include_usage: bool = False,
        lora: LoraRef | None = None,
    ) -> Job:
        """A job whose deadline is ``timeout_s`` after arrival (at most the server's
        ``request_timeout_s``), run with adapter ``lora`` (its answers then name the
        adapter as their model)."""
        timeout = min(self.config.request_timeout_s, timeout_s or math.inf)
        return Job(
            kind,
            request_id,
            self.model_name if lora is None else lora.name,
            prompts,
            sampling,
            timeout,
            arrival + timeout,
            arrival,
            include_usage,
            lora=lora,
        )

    async def start(self, job: Job, priority: int = 0, cache_salt: str | None = None) -> None:
        """Submit every prompt; on any refusal, abort the ones already started (the
        error raises as the ``APIError`` both doors map)."""
        job.started = time.monotonic()
        salt = salt_key(cache_salt) if cache_salt is not None else None
        try:
            for k, prompt in enumerate(job.prompts):
                remaining = job.deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineError("the request's deadline passed before it was placed")
                stream = await self.client.submit(
                    job.request_id if len(job.prompts) == 1 else f"{job.request_id}-{k}",
                    prompt,
                    job.sampling,
                    priority=priority,
                    cache_salt=salt,
                    timeout_s=min(remaining, self.config.queue_timeout_s),
                    lora=job.lora,
                    traced=job.trace is not None,
                )
                job.streams.append(stream)
        except BaseException as error:
            await close_streams(job.streams)
            if not isinstance(error, Exception):  # cancelled: the client left
                raise
            raise api_error(error) from None

    async def events(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) from all of the job's streams, until the deadline."""
        if len(job.streams) == 1:  # the usual case: no task per delta
            async with contextlib.aclosing(self._one_stream(job)) as deltas:
                async for delta in deltas:  # closed (and its stream) when the caller leaves
                    yield 0, delta
            return
        pending = {asyncio.ensure_future(anext(stream)): k for k, stream in enumerate(job.streams)}
        try:
            while pending:
                timeout = job.deadline - time.monotonic()
                done, _ = await asyncio.wait(
                    pending, timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    raise deadline_error(job)
                for task in done:
                    k = pending.pop(task)
                    try:
                        delta = task.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(anext(job.streams[k]))] = k
                    yield k, delta
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await close_streams(job.streams)

    async def _one_stream(self, job: Job) -> AsyncIterator[RequestOutput]:
        (stream,) = job.streams
        try:
            while True:
                deadline = asyncio.timeout(job.deadline - time.monotonic())
                try:
                    async with deadline:
                        delta = await anext(stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if deadline.expired():
                        raise deadline_error(job) from None
                    raise
                yield delta
        finally:
            await close_streams(job.streams)

    def record(self, job: Job, k: int, delta: RequestOutput) -> Choice:
        """Note a delta of prompt ``k`` in its choice; return the choice."""
        choice = job.choices.get(job.choice_index(k, delta))
        if choice is None:
            choice = job.choices[job.choice_index(k, delta)] = Choice()
            if job.sampling.parallel_tokens is not None:
                choice.parallel_sets = []
        if delta.token_ids and job.first_token is None:
            job.first_token = time.monotonic()
        if delta.prompt_logprobs is not None:
            job.prompt_logprobs[k] = delta.prompt_logprobs
        choice.text.append(delta.text)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        if delta.parallel_sets and choice.parallel_sets is not None:
            choice.parallel_sets.extend(delta.parallel_sets)
        if delta.speculative is not None:
            choice.speculative = delta.speculative
        if delta.finished:
            choice.completion_tokens = delta.completion_tokens
            choice.finish_reason = finish_reason(delta)
            if delta.times is not None and k == 0:  # traced: the engine's phases (the
                job.engine_times = delta.times  # last output to finish ends the decode)
        return choice

    async def collect(self, job: Job, endpoint: str) -> None:
        """Run a job to its end (a whole, not streamed, answer), recording its metrics."""
        status = 499  # the client went away (cancelled), unless we get to the end
        self.metrics.in_flight.inc()
        try:
            async with contextlib.aclosing(self.events(job)) as events:
                async for k, delta in events:
                    self.record(job, k, delta)
            status = 200
        except Exception as error:
            failure = api_error(error)
            status = failure.status
            raise failure from None
        finally:
            self.metrics.in_flight.dec()
            self.finished(job, endpoint, status)

    def refused(self, endpoint: str, status: int) -> None:
        """Count a request refused before it became a job (``status`` as HTTP numbers it)."""
        self.metrics.requests.labels(endpoint, str(status)).inc()

    def finished(self, job: Job, endpoint: str, status: int) -> None:
        """Record a job's request metrics (``status`` as HTTP numbers it)."""
        longest = max((c.completion_tokens for c in job.choices.values()), default=0)
        self.metrics.finished(
            endpoint,
            status,
            job.arrival,
            job.first_token,
            time.monotonic(),
            job.prompt_tokens,
            job.completion_tokens,
            longest,
            job.started,
            job.streams[0].timings if job.streams else None,
            [c.finish_reason for c in job.choices.values() if c.finish_reason is not None],
            job.sampling.n,
            job.sampling.max_tokens,
        )
        if job.trace is not None and self.tracer is not None:
            stream = job.streams[0] if job.streams else None
            placement = stream.placement if stream is not None else None
            try:
                self.tracer.record(
                    job,
                    endpoint,
                    status,
                    stream.timings if stream is not None else None,
                    placement.worker_id if placement is not None else None,
                )
            except Exception:  # a trace lost must not fail the answer
                logger.exception("could not record the trace of request %s", job.request_id)
