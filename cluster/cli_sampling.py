"""A request's sampling settings from the command line's flags (``tessera generate``
and ``tessera cluster``), through the one wire table of sampling fields
(``tessera.workers.decoding.sampling_fields``)."""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

if typing.TYPE_CHECKING:
    from tessera.workers.api import SamplingParams


def early_stopping(text: str) -> bool | str:
    """``--early-stopping``: true, false or never."""
    value = {"true": True, "false": False, "never": "never"}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"must be true, false or never, got {text!r}")
    return value


def sampling_from_args(args: argparse.Namespace, nested: bool = True) -> SamplingParams:
    """The request's sampling settings from the flags, through the one wire table: a
    flag named as a sampling field is that field; with ``nested`` (``generate``), the
    speculative and parallel-token flags make its two nested settings (``tessera
    cluster``'s speculative flags are the workers' defaults instead)."""
    from tessera.workers.decoding.sampling_fields import FIELDS, sampling_params

    values = {
        field.name: getattr(args, field.name)
        for field in FIELDS
        if field.nested is None and hasattr(args, field.name)
    }
    if not nested:
        return sampling_params(values)
    if args.speculative_method is not None:
        values["speculative"] = {
            "method": args.speculative_method,
            "num_tokens": args.speculative_num_tokens,
        }
    if args.parallel_tokens is not None:
        values["parallel_tokens"] = {
            "threshold": args.parallel_tokens,
            "max_width": args.parallel_max_width,
            "mode": args.parallel_mode,
        }
    structured = structured_from_args(args)
    if structured is not None:
        values["structured"] = structured
    return sampling_params(values)


def structured_from_args(args: argparse.Namespace) -> dict[str, str] | None:
    """``--json-schema FILE`` / ``--regex`` / ``--choice`` / ``--grammar FILE``: at most one."""
    given = {
        "json": args.json_schema,
        "regex": args.regex,
        "choice": None if args.choice is None else json.dumps(args.choice),
        "grammar": args.grammar,
    }
    chosen = {kind: value for kind, value in given.items() if value is not None}
    if len(chosen) > 1:
        raise ValueError(
            "structured outputs: give one of --json-schema, --regex, --choice, --grammar"
        )
    if not chosen:
        return None
    ((kind, value),) = chosen.items()
    if kind in ("json", "grammar"):
        flag = "--json-schema" if kind == "json" else "--grammar"
        try:
            value = Path(value).read_text()
        except OSError as error:
            raise ValueError(f"{flag}: cannot read {value!r}: {error.strerror}") from None
    return {"kind": kind, "spec": value}
