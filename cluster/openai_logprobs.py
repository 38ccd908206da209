"""Token logprobs in the shapes of both endpoints: the completions API's lists (with
text offsets, and the echoed prompt's), the chat API's ``content`` entries, and vLLM's
``prompt_logprobs``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.workers.api import TokenLogprob


class LogprobFormatter:
    """Token logprobs in both endpoints' shapes; token strings decoded one by one."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion(
        self,
        logprobs: Sequence[TokenLogprob | None],
        offset: int,
        out: dict[str, list] | None = None,
    ) -> tuple[dict[str, list], int]:
        """``choices[i].logprobs`` of the completions API (appended to ``out``, e.g. the
        echoed prompt's); returns it and the text offset after it. A ``None`` entry is
        the prompt's first token: ``prompt_token_id`` names it, with no logprob."""
        if out is None:
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in logprobs:
            text = self.token(entry.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(entry.logprob)
            top = {self.token(t): lp for t, lp in entry.top}
            top.setdefault(text, entry.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def prompt(
        self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], offset: int = 0
    ) -> tuple[dict[str, list], int]:
        """The echoed prompt's part of ``choices[i].logprobs``: its first token has
        none (OpenAI's null)."""
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        first = self.token(prompt_ids[0])
        out["tokens"].append(first)
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        out["text_offset"].append(offset)
        return self.completion([e for e in logprobs[1:] if e is not None], offset + len(first), out)

    def prompt_logprobs(self, logprobs: Sequence[TokenLogprob | None]) -> list[Any]:
        """vLLM's ``prompt_logprobs``: None for the first token, then per token a map
        of token id to its logprob and text (the chosen one and the top ones)."""
        out: list[Any] = []
        for entry in logprobs:
            if entry is None:
                out.append(None)
                continue
            ranked = {entry.token_id: entry.logprob, **dict(entry.top)}
            out.append(
                {
                    str(t): {"logprob": lp, "decoded_token": self.token(t)}
                    for t, lp in ranked.items()
                }
            )
        return out

    def chat(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """``choices[i].logprobs.content`` of the chat API."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [
            {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
            for e in logprobs
        ]
