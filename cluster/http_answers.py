"""How the HTTP door writes a job's answer: whole, or as server-sent events.

Completions and chat share one builder of choices (``choice_entry``) and one of the
envelope around them (``envelope``: a whole response, or a streamed chunk); there the
endpoints differ only in names (the ``object`` of a response and of a chunk, the key of
a choice's output). What a choice holds differs: a completion's text follows its echoed
prompt, whose tokens carry logprobs too (computed in the prefill); a chat choice is a
message. A streamed chat choice's first chunk names its role; with tools offered, its
calls are parsed once its output is whole, then streamed as OpenAI does: each call's id
and name, then its arguments in pieces. Functions offered the deprecated way
(``functions``) get their one call as OpenAI answers it: ``function_call`` (name and
arguments) in the message or the deltas, and finish reason ``function_call``. With a
reasoning parser (``reasoning``), a chat choice's reasoning goes to ``reasoning_content``
(streamed as it comes, tools or not) and only its answer to ``content`` and the tool-call
parser. A stream that fails after it began ends with an error event, then ``data:
[DONE]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

from tessera.cluster import tools as tool_calls
from tessera.cluster.front_end import FrontEnd
from tessera.cluster.jobs import Choice, Job
from tessera.cluster.openai_chat import ChatCompletionRequest
from tessera.cluster.openai_errors import api_error
from tessera.cluster.openai_logprobs import LogprobFormatter
from tessera.cluster.openai_requests import CompletionRequest
from tessera.cluster.openai_responses import parallel_sets, speculative_stats, usage
from tessera.cluster.reasoning import ReasoningSplitter, split_reasoning
from tessera.workers.api import RequestOutput

#: Characters of a tool call's arguments per streamed delta.
TOOL_ARGUMENT_PIECE = 16
#: An answer longer than this is parsed for tool calls on the replica's thread pool: the
#: parser is linear, but a megabyte of calls takes ~0.2 s of JSON (every stream and
#: ``/health`` would wait); below it a thread hop would cost more than the parse.
TOOL_PARSE_ON_LOOP_CHARS = 8192
#: Per endpoint (``Job.kind``), whole and streamed: a response's ``object``...
_OBJECT = {
    "completion": ("text_completion", "text_completion"),
    "chat": ("chat.completion", "chat.completion.chunk"),
}
#: ...and the key of a choice's output.
_OUTPUT = {"completion": ("text", "text"), "chat": ("message", "delta")}


def choice_extras(choice: Choice, delta: RequestOutput | None = None) -> dict:
    """A choice's ``parallel_tokens`` and ``speculative`` fields, only where the
    request asked for them: a streamed ``delta``'s own sets, or (None) all of them."""
    out: dict = {}
    sets = choice.parallel_sets if delta is None else delta.parallel_sets
    if sets is not None:
        out["parallel_tokens"] = parallel_sets(sets)
    if choice.speculative is not None and (delta is None or delta.finished):
        out["speculative"] = speculative_stats(choice.speculative)
    return out


def choice_entry(
    kind: str,
    index: int,
    output: Any,
    logprobs: Any,
    finish: str | None,
    *,
    streamed: bool = False,
    extras: dict | None = None,
    prompt_logprobs: list | None = None,
) -> dict[str, Any]:
    """One entry of ``choices`` of endpoint ``kind``: ``index``, the output under its
    key, ``logprobs``, ``finish_reason``, then the ``extras`` (``choice_extras``).
    vLLM's ``prompt_logprobs`` (given: asked for) comes last in a whole choice, and
    before ``finish_reason`` in a streamed one (a choice's first chunk)."""
    entry = {"index": index, _OUTPUT[kind][streamed]: output, "logprobs": logprobs}
    if streamed and prompt_logprobs is not None:
        entry["prompt_logprobs"] = prompt_logprobs
    entry["finish_reason"] = finish
    if extras:
        entry |= extras
    if not streamed and prompt_logprobs is not None:
        entry["prompt_logprobs"] = prompt_logprobs
    return entry


def envelope(job: Job, choices: list[dict], streamed: bool = False, final: bool = False) -> dict:
    """The object around ``choices``: a whole response, or a streamed chunk. A whole
    response has ``usage``; streamed chunks have it only when the request asked
    (``stream_options.include_usage``): null, but in the ``final`` chunk, which has no
    choices and ends the stream."""
    out = {
        "id": job.request_id,
        "object": _OBJECT[job.kind][streamed],
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if not streamed:
        out["usage"] = usage(job.prompt_tokens, job.completion_tokens)
    elif job.include_usage:
        out["usage"] = usage(job.prompt_tokens, job.completion_tokens) if final else None
    return out


class AnswerWriter:
    """One replica's writer of answers, over its ``FrontEnd`` (the job's events and
    choices) and the model's tokenizer (token strings of logprobs)."""

    def __init__(self, front: FrontEnd) -> None:
        self.front = front
        self.logprobs = LogprobFormatter(front.tokenizer)

    # ------------------------------------------------------------------ whole
    def completion(self, job: Job, body: CompletionRequest, echo: list[str]) -> dict:
        """The whole completions response of a collected job; ``echo``: per prompt, the
        text its choices start with (empty without ``echo``)."""
        choices = []
        for index in sorted(job.choices):
            choice = job.choices[index]
            k = index // body.n
            logprobs = None
            if body.logprobs is not None:
                logprobs = self._completion_logprobs(job, k, choice.logprobs, len(echo[k]), body)
            text = echo[k] + "".join(choice.text)
            extras = choice_extras(choice)
            prompt_logprobs = self._prompt_logprobs(job, k, body)
            choices.append(
                choice_entry(
                    job.kind,
                    index,
                    text,
                    logprobs,
                    choice.finish_reason,
                    extras=extras,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return envelope(job, choices)

    async def chat(self, job: Job, body: ChatCompletionRequest) -> dict:
        """The whole chat response of a collected job: a tool call's message, when the
        model made calls to the tools offered."""
        choices = []
        for index in sorted(job.choices):
            choice = job.choices[index]
            logprobs = None
            if body.logprobs:
                logprobs = {"content": self.logprobs.chat(choice.logprobs)}
            message = await self._chat_message(job, "".join(choice.text), body.legacy_calls)
            calls = "function_call" if body.legacy_calls else "tool_calls"
            finish = calls if calls in message else choice.finish_reason
            extras = choice_extras(choice)
            prompt_logprobs = self._prompt_logprobs(job, 0, body)
            choices.append(
                choice_entry(
                    job.kind,
                    index,
                    message,
                    logprobs,
                    finish,
                    extras=extras,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return envelope(job, choices)

    # ------------------------------------------------------------------ streamed
    def sse(self, job: Job, chunks: AsyncIterator[dict], endpoint: str) -> StreamingResponse:
        """``chunks`` as server-sent events; the job's metrics when the stream ends."""

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

    async def completion_chunks(
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
                prompt_logprobs = self._prompt_logprobs(job, k, body) if fresh else None
                extras = choice_extras(choice, delta)
                entry = choice_entry(
                    job.kind,
                    index,
                    text,
                    logprobs,
                    finish,
                    streamed=True,
                    extras=extras,
                    prompt_logprobs=prompt_logprobs,
                )
                yield envelope(job, [entry], streamed=True)
        if job.include_usage:
            yield envelope(job, [], streamed=True, final=True)

    async def chat_chunks(self, job: Job, body: ChatCompletionRequest) -> AsyncIterator[dict]:
        fmt = self.front.reasoning
        splitters: dict[int, ReasoningSplitter] = {}  # per choice, with a reasoning parser
        answers: dict[int, list[str]] = {}  # per choice, with tools: its answer so far
        async with contextlib.aclosing(self.front.events(job)) as events:
            async for k, delta in events:
                choice = self.front.record(job, k, delta)
                index = job.choice_index(k, delta)
                if not choice.started:  # the first chunk of a choice names its role
                    choice.started = True
                    role = {"role": "assistant", "content": ""}
                    entry = choice_entry(job.kind, index, role, None, None, streamed=True)
                    yield envelope(job, [entry], streamed=True)
                reasoning, content = "", delta.text
                if fmt is not None:
                    splitter = splitters.setdefault(index, ReasoningSplitter(fmt))
                    reasoning, content = splitter.feed(delta.text)
                    if delta.finished:
                        held = splitter.finish()
                        reasoning, content = reasoning + held[0], content + held[1]
                if job.tool_names:  # calls are known once the answer is whole
                    answers.setdefault(index, []).append(content)
                    if reasoning:  # the reasoning streams as it comes
                        piece = {"reasoning_content": reasoning}
                        entry = choice_entry(job.kind, index, piece, None, None, streamed=True)
                        yield envelope(job, [entry], streamed=True)
                    if delta.finished:
                        answer = "".join(answers.pop(index))
                        entries = await self._tool_call_entries(
                            job, index, choice, answer, body.legacy_calls
                        )
                        for entry in entries:
                            yield envelope(job, [entry], streamed=True)
                    continue
                logprobs = None
                if body.logprobs:
                    logprobs = {"content": self.logprobs.chat(delta.logprobs or ())}
                message = {"reasoning_content": reasoning} if reasoning else {}
                if content:
                    message["content"] = content
                finish = choice.finish_reason if delta.finished else None
                extras = choice_extras(choice, delta)
                entry = choice_entry(
                    job.kind, index, message, logprobs, finish, streamed=True, extras=extras
                )
                yield envelope(job, [entry], streamed=True)
        if job.include_usage:
            yield envelope(job, [], streamed=True, final=True)

    # ------------------------------------------------------------------ parts
    def _completion_logprobs(
        self, job: Job, k: int, logprobs: list, offset: int, body: CompletionRequest
    ) -> dict[str, list]:
        """A whole choice's ``logprobs``: the echoed prompt's (computed in the prefill)
        first, then the completion's."""
        if body.echo and k in job.prompt_logprobs:
            prompt_part, _ = self.logprobs.prompt(job.prompts[k], job.prompt_logprobs[k])
            return self.logprobs.completion(logprobs, offset, prompt_part)[0]
        return self.logprobs.completion(logprobs, offset)[0]

    def _prompt_logprobs(self, job: Job, k: int, body: Any) -> list | None:
        """``prompt_logprobs`` (vLLM's extra) for a choice of prompt ``k``; None unless
        asked for."""
        if body.prompt_logprobs is None or k not in job.prompt_logprobs:
            return None
        return self.logprobs.prompt_logprobs(job.prompt_logprobs[k])

    async def _parse_calls(
        self, job: Job, text: str, legacy: bool
    ) -> tuple[str | None, list[tool_calls.ToolCall]]:
        """``tools.parse`` of a choice's answer, off the event loop when it is long;
        ``legacy`` (``functions``): the first call only, the rest stays text."""
        args = (text, self.front.tool_format, job.tool_names, 1 if legacy else None)
        if len(text) <= TOOL_PARSE_ON_LOOP_CHARS:
            return tool_calls.parse(*args)
        return await self.front.off_loop(tool_calls.parse, *args)

    async def _chat_message(self, job: Job, text: str, legacy: bool) -> dict[str, Any]:
        """A whole chat choice's message: with a reasoning parser, its reasoning apart
        (``reasoning_content``); with tools offered, the calls its answer makes
        (``legacy``: its one call as ``function_call``)."""
        fmt = self.front.reasoning
        if fmt is None:
            reasoning, content = None, text
        else:
            reasoning, content = split_reasoning(fmt, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if fmt is not None:
            message["reasoning_content"] = reasoning
        if job.tool_names and content is not None:  # calls are in the answer only
            rest, calls = await self._parse_calls(job, content, legacy)
            if calls and legacy:
                message["content"] = rest
                message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            elif calls:
                message["content"] = rest
                message["tool_calls"] = [call.message() for call in calls]
        return message

    async def _tool_call_entries(
        self, job: Job, index: int, choice: Choice, text: str, legacy: bool
    ) -> list[dict]:
        """A finished choice of a chat with tools, as OpenAI streams it: each call's
        id and name, then its arguments in pieces (``legacy``: the one call's name,
        then its arguments, as ``function_call``); or the answer ``text``, if it made
        no call."""
        content, calls = await self._parse_calls(job, text, legacy)
        if not calls:
            deltas = [{"content": text}] if text else []
            finish = choice.finish_reason
        elif legacy:
            (call,) = calls
            deltas = [{"content": content}] if content else []
            deltas.append({"function_call": {"name": call.name, "arguments": ""}})
            for start in range(0, len(call.arguments), TOOL_ARGUMENT_PIECE):
                piece = call.arguments[start : start + TOOL_ARGUMENT_PIECE]
                deltas.append({"function_call": {"arguments": piece}})
            finish = "function_call"
        else:
            deltas = [{"content": content}] if content else []
            for i, call in enumerate(calls):
                first = call.message(i)
                first["function"] = {"name": call.name, "arguments": ""}
                deltas.append({"tool_calls": [first]})
                for start in range(0, len(call.arguments), TOOL_ARGUMENT_PIECE):
                    piece = call.arguments[start : start + TOOL_ARGUMENT_PIECE]
                    deltas.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
            finish = "tool_calls"
        out = [choice_entry(job.kind, index, delta, None, None, streamed=True) for delta in deltas]
        out.append(choice_entry(job.kind, index, {}, None, finish, streamed=True))
        return out
