"""Prompts for ``tessera bench serve``: random, a JSONL file or a ShareGPT file.

random: prompts of exactly ``input_len`` tokens. On ``/v1/completions`` they are token
ids drawn from ``bench_schedule.TOKEN_IDS`` (any vocabulary of 30k or more holds them), so the
length is exact without a tokenizer; the chat endpoint takes text only, so there a
prompt is ``input_len`` random words and the summary's input tokens are what the
server's usage reports.

jsonl: one JSON object per line with a ``prompt`` (text) and optionally its own output
length, ``output_len`` or ``max_tokens`` (else ``--jsonl-output-len``); blank lines are
skipped.

sharegpt: a JSON list of ``{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}``: the first human turn is the prompt and the
gpt turn after it gives the output length, ``ceil(characters / 4)`` (the usual
four-characters-a-token estimate: the client has no tokenizer), or
``--sharegpt-output-len`` for every prompt. Entries without a human turn answered by
a gpt turn are skipped, as vLLM's benchmark does.

A file's prompts are shuffled with the seed and repeated when fewer than asked for.
A bad file raises ``DatasetError`` naming the file and line (or entry).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from tessera.cluster.bench import CHAT
from tessera.cluster.bench_schedule import token_prompt

DATASETS = ("random", "jsonl", "sharegpt")
#: Characters per token for ShareGPT's answers when no --sharegpt-output-len is given.
CHARS_PER_TOKEN = 4
#: Words for random chat prompts: common, each one token in most vocabularies.
WORDS = tuple(
    " ".join(
        (
            "time year people way day man thing woman life child world school state family",
            "student group country problem hand part place case week company system program",
            "question work government number night point home water room mother area money",
            "story fact month lot right study book eye job word business issue side kind head",
        )
    ).split()
)


class DatasetError(ValueError):
    """A bad dataset file or option; the message names it."""


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | list[int]  # token ids for random prompts on the completions endpoint
    output_len: int


def random_prompts(
    count: int, input_len: int, output_len: int, seed: int, endpoint: str
) -> list[Prompt]:
    if input_len < 1 or output_len < 1:
        raise DatasetError("--random-input-len and --random-output-len must be at least 1")
    draws = random.Random(f"{seed}-random-prompts")
    if endpoint == CHAT:
        return [
            Prompt(" ".join(draws.choice(WORDS) for _ in range(input_len)), output_len)
            for _ in range(count)
        ]
    return [Prompt(token_prompt(draws, input_len), output_len) for _ in range(count)]


def _output_len(entry: dict, where: str, default: int) -> int:
    for key in ("output_len", "max_tokens"):
        if key in entry:
            value = entry[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DatasetError(f"{where}: {key} must be a positive integer, not {value!r}")
            return value
    return default


def load_jsonl(path: Path, default_output_len: int) -> list[Prompt]:
    """Each line's ``prompt`` and its ``output_len``/``max_tokens``, else the default."""
    prompts = []
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(entry, dict):
            raise DatasetError(f"{where}: expected an object with a prompt")
        prompt = entry.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
        prompts.append(Prompt(prompt, _output_len(entry, where, default_output_len)))
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    return prompts


def load_sharegpt(path: Path, output_len: int | None) -> list[Prompt]:
    """The first human turn of each conversation and its gpt answer's length (or
    ``output_len`` for every prompt)."""
    try:
        entries = json.loads(_read(path))
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path}:{error.lineno}: not JSON ({error.msg})") from None
    if not isinstance(entries, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations")
    prompts = []
    for index, entry in enumerate(entries):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise DatasetError(f"{path}: entry {index}: expected an object with conversations")
        pair = _first_exchange(turns)
        if pair is None:
            continue
        question, answer = pair
        length = output_len or max(1, math.ceil(len(answer) / CHARS_PER_TOKEN))
        prompts.append(Prompt(question, length))
    if not prompts:
        raise DatasetError(f"{path}: no conversation with a human turn and a gpt answer")
    return prompts


def _first_exchange(turns: list) -> tuple[str, str] | None:
    for turn, after in zip(turns, turns[1:], strict=False):
        if not (isinstance(turn, dict) and isinstance(after, dict)):
            return None
        if turn.get("from") == "human" and after.get("from") == "gpt":
            question, answer = turn.get("value"), after.get("value")
            if isinstance(question, str) and question and isinstance(answer, str):
                return question, answer
            return None
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"--dataset-path {path}: {error}") from None


def sample(prompts: list[Prompt], count: int, seed: int) -> list[Prompt]:
    """``count`` prompts: shuffled with ``seed``, repeated when the file has fewer."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(count)]
