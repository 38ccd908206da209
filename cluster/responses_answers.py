"""How the HTTP door answers ``POST /v1/responses``: the chat path's answer (a whole
chat message, or its streamed chunks from ``http_answers.AnswerWriter``) as OpenAI's
response object, or as the Responses API's typed server-sent events (``event: TYPE``,
``data: JSON``, each with its ``sequence_number``):

    response.created, response.in_progress,
    per output item: response.output_item.added,
      a message:     response.content_part.added, response.output_text.delta...,
                     response.output_text.done, response.content_part.done
      reasoning:     the same with response.reasoning_text.delta / .done
      a call:        response.function_call_arguments.delta..., .done
    response.output_item.done, then response.completed (or response.incomplete)

A stream that fails after it began ends with an ``error`` event. Output items: the
reasoning (with a reasoning parser), the answer's message, then the function calls.
Responses are kept (``store``) in the cluster's ``ResponseStore``.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

from tessera.cluster.front_end import FrontEnd
from tessera.cluster.http_answers import AnswerWriter
from tessera.cluster.jobs import Job
from tessera.cluster.openai_errors import APIError, api_error
from tessera.cluster.openai_responses_api import ResponsesChatRequest, ResponsesRequest
from tessera.cluster.response_store import ResponseStore

#: The metrics' endpoint label.
ENDPOINT = "responses"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str, param: str = "response_id") -> APIError:
    """OpenAI's 404 for an id that no stored response has (never stored, expired or
    deleted)."""
    return APIError(
        404,
        f"{param}: no response with id {response_id!r} is stored here",
        param=param,
        code="not_found",
    )


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id or _id("msg"),
        "role": "assistant",
        "status": status,
        "content": [part] if status == "completed" else [],
    }


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {
        "type": "reasoning",
        "id": item_id or _id("rs"),
        "summary": [],
        "content": content,
        "status": status,
    }


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    """A chat tool call (``{"id", "function": {"name", "arguments"}}``) as an item."""
    return {
        "type": "function_call",
        "id": item_id or _id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"].get("arguments", ""),
        "status": status,
    }


def output_items(message: dict) -> list[dict]:
    """A whole chat message as output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or ""))
    items += [call_item(call) for call in calls]
    return items


class ResponsesWriter:
    """One replica's Responses API answers over its chat answers, and its stored
    responses."""

    def __init__(self, front: FrontEnd, answers: AnswerWriter, store: ResponseStore) -> None:
        self.front = front
        self.answers = answers
        self.store = store

    # ------------------------------------------------------------------ requests
    async def chat_request(self, body: ResponsesRequest) -> tuple[ResponsesChatRequest, list[dict]]:
        """The chat request of ``body``, and its conversation's items: those of the
        response it continues, then its input."""
        earlier: list[dict] = []
        if body.previous_response_id is not None:
            stored = await self.front.off_loop(self.store.get, body.previous_response_id)
            if stored is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            earlier = stored.items
        return body.chat_request(earlier), [*earlier, *body.input_items()]

    async def retrieve(self, response_id: str) -> dict:
        stored = await self.front.off_loop(self.store.get, response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    async def delete(self, response_id: str) -> dict:
        if not await self.front.off_loop(self.store.delete, response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # ------------------------------------------------------------------ answers
    def response(
        self,
        job: Job,
        body: ResponsesRequest,
        chat: ResponsesChatRequest,
        output: list,
        finish: str | None,
    ) -> dict:
        """The response object; ``finish``: the chat choice's finish reason (None while
        it is in progress)."""
        status = "in_progress" if finish is None else "completed"
        if finish == "length":
            status = "incomplete"
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        choice = body.tool_choice
        fmt = body.text.format if body.text is not None else None
        return {
            "id": "resp_" + job.request_id.split("-", 1)[1],
            "object": "response",
            "created_at": job.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": job.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.store,
            "temperature": chat.temperature,
            "text": {"format": fmt.model_dump(by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump()
            if hasattr(choice, "model_dump")
            else (choice or "auto"),
            "tools": tools,
            "top_p": chat.top_p,
            "truncation": "disabled",
            "usage": None if finish is None else self._usage(job),
            "user": body.user,
            "metadata": body.metadata or {},
        }

    @staticmethod
    def _usage(job: Job) -> dict:
        return {
            "input_tokens": job.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": job.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": job.prompt_tokens + job.completion_tokens,
        }

    async def _keep(self, body: ResponsesRequest, conversation: list, response: dict) -> None:
        if body.store:
            items = [*conversation, *response["output"]]
            await self.front.off_loop(self.store.put, response, items)

    async def whole(
        self, job: Job, body: ResponsesRequest, chat: ResponsesChatRequest, conversation: list
    ) -> dict:
        """The response of a collected job; ``conversation``: its items
        (``chat_request``'s)."""
        answer = await self.answers.chat(job, chat)
        choice = answer["choices"][0]
        output = output_items(choice["message"])
        response = self.response(job, body, chat, output, choice["finish_reason"] or "stop")
        await self._keep(body, conversation, response)
        return response

    # ------------------------------------------------------------------ streamed
    def stream(
        self, job: Job, body: ResponsesRequest, chat: ResponsesChatRequest, conversation: list
    ) -> StreamingResponse:
        """The job's answer as typed server-sent events; its metrics when it ends."""
        numbers = itertools.count()
        events = self._events(job, body, chat, numbers, conversation)

        async def lines() -> AsyncIterator[bytes]:
            status = 499
            self.front.metrics.in_flight.inc()
            try:
                async with contextlib.aclosing(events):
                    async for event in events:
                        yield b"event: " + event["type"].encode() + b"\ndata: "
                        yield orjson.dumps(event) + b"\n\n"
                status = 200
            except Exception as error:  # after the first byte: an error event
                failure = api_error(error)
                status = failure.status
                event = {
                    "type": "error",
                    "code": failure.code,
                    "message": failure.message,
                    "param": failure.param,
                    "sequence_number": next(numbers),
                }
                yield b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
            finally:  # also when the client left (cancelled): its request is aborted
                self.front.metrics.in_flight.dec()
                self.front.finished(job, ENDPOINT, status)

        return StreamingResponse(lines(), media_type="text/event-stream")

    async def _events(
        self,
        job: Job,
        body: ResponsesRequest,
        chat: ResponsesChatRequest,
        numbers: itertools.count,
        conversation: list[dict],
    ) -> AsyncIterator[dict]:
        def event(kind: str, **fields: Any) -> dict:
            return {"type": kind, "sequence_number": next(numbers), **fields}

        start = self.response(job, body, chat, [], None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        output: list[dict] = []  # the items, done or open
        open_item: dict | None = None  # the item being streamed
        texts: list[str] = []  # its text (or arguments) so far
        finish = None

        def opened(item: dict) -> list[dict]:
            nonlocal open_item
            open_item = item
            texts.clear()
            output.append(item)
            out = [event("response.output_item.added", output_index=len(output) - 1, item=item)]
            part = _empty_part(item)
            if part is not None:
                out.append(event("response.content_part.added", part=part, **_place(output)))
            return out

        def closed() -> list[dict]:
            nonlocal open_item
            item, open_item = open_item, None
            if item is None:
                return []
            text = "".join(texts)
            index = len(output) - 1
            out = []
            if item["type"] == "function_call":
                done = call_item(
                    {"id": item["call_id"], "function": {"name": item["name"], "arguments": text}},
                    item_id=item["id"],
                )
                out.append(
                    event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=text,
                    )
                )
            else:
                make = message_item if item["type"] == "message" else reasoning_item
                done = make(text, item_id=item["id"])
                part = done["content"][0]
                kind = "output_text" if item["type"] == "message" else "reasoning_text"
                fields = {"logprobs": []} if item["type"] == "message" else {}
                out.append(event(f"response.{kind}.done", text=text, **fields, **_place(output)))
                out.append(event("response.content_part.done", part=part, **_place(output)))
            output[index] = done
            out.append(event("response.output_item.done", output_index=index, item=done))
            return out

        def streamed(kind: str, piece: str) -> list[dict]:
            out = []
            if open_item is None or open_item["type"] != kind:
                out += closed()
                make = message_item if kind == "message" else reasoning_item
                out += opened(make("", status="in_progress"))
            texts.append(piece)
            name = "output_text" if kind == "message" else "reasoning_text"
            fields = {"logprobs": []} if kind == "message" else {}
            out.append(event(f"response.{name}.delta", delta=piece, **fields, **_place(output)))
            return out

        chunks = self.answers.chat_chunks(job, chat)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                for choice in chunk["choices"]:
                    finish = choice["finish_reason"] or finish
                    delta = choice["delta"]
                    pending: list[dict] = []
                    if delta.get("reasoning_content"):
                        pending += streamed("reasoning", delta["reasoning_content"])
                    if delta.get("content"):
                        pending += streamed("message", delta["content"])
                    for call in delta.get("tool_calls", ()):
                        if "id" in call:
                            pending += closed()
                            pending += opened(call_item(call, status="in_progress"))
                        piece = call["function"].get("arguments", "")
                        if piece:
                            texts.append(piece)
                            pending.append(
                                event(
                                    "response.function_call_arguments.delta",
                                    item_id=open_item["id"],
                                    output_index=len(output) - 1,
                                    delta=piece,
                                )
                            )
                    for out in pending:
                        yield out
        for out in closed():
            yield out
        if not output:  # an empty answer is still a message
            for out in [*opened(message_item("", status="in_progress")), *closed()]:
                yield out
        response = self.response(job, body, chat, output, finish or "stop")
        await self._keep(body, conversation, response)
        kind = "incomplete" if response["status"] == "incomplete" else "completed"
        yield event(f"response.{kind}", response=response)


def _empty_part(item: dict) -> dict | None:
    if item["type"] == "message":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    if item["type"] == "reasoning":
        return {"type": "reasoning_text", "text": ""}
    return None


def _place(output: list[dict]) -> dict:
    """Where the open item's (first) content part is."""
    return {"item_id": output[-1]["id"], "output_index": len(output) - 1, "content_index": 0}
