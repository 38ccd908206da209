"""``tessera generate``: one prompt through an engine in this process, its completion
streamed to stdout and its timing to stderr. The command line imports this module
only to run the command: it loads the engine (torch)."""

from __future__ import annotations

import argparse
import sys
import time

from tessera.cluster import exit_status
from tessera.workers.api import InvalidRequestError, SamplingParams
from tessera.workers.config import PRECISION_TEXT, EngineConfig
from tessera.workers.engine.engine import Engine


def generate(args: argparse.Namespace, sampling: SamplingParams, config: EngineConfig) -> int:
    """Load the model, run ``args.prompt`` with ``sampling``; the exit status."""
    print("loading model ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        engine = Engine(config)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_status.USAGE
    print(
        f"loaded in {time.perf_counter() - start:.1f} s: {PRECISION_TEXT[engine.loaded.precision]}",
        file=sys.stderr,
        flush=True,
    )
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    try:
        engine.add_request("cli", prompt, sampling)
    except InvalidRequestError as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_status.USAGE
    if sampling.num_samples > 1:
        return _print_whole(engine)
    start = time.perf_counter()
    first_token_at = None
    while engine.has_work():
        for output in engine.step():
            if first_token_at is None and output.token_ids:
                first_token_at = time.perf_counter()
            sys.stdout.write(output.text if output.parallel_sets is None else _sets(output))
            sys.stdout.flush()
            if output.finished:
                elapsed = time.perf_counter() - start
                sys.stdout.write("\n")
                spec = output.speculative
                speculation = ""
                if spec is not None:
                    speculation = (
                        f", drafts accepted {spec.accepted}/{spec.proposed} "
                        f"({spec.acceptance_rate:.0%}), {spec.mean_tokens_per_step:.2f} "
                        "tokens per verification step"
                    )
                print(
                    f"[{output.completion_tokens} tokens in {elapsed:.2f} s, "
                    f"{output.completion_tokens / elapsed:.1f} tok/s, "
                    f"time to first token {(first_token_at or time.perf_counter()) - start:.3f} s"
                    f"{speculation}, finish reason: {output.finish_reason.value}]",
                    file=sys.stderr,
                )
    return exit_status.OK


def _sets(output) -> str:
    """A parallel-tokens delta as text, each set of two or more tokens as [a|b|c]."""
    return "".join(
        s.tokens[0] if len(s.tokens) == 1 else "[" + "|".join(s.tokens) + "]"
        for s in output.parallel_sets
    )


def _print_whole(engine) -> int:
    """n > 1 and beam search: print each output whole, in index order."""
    start = time.perf_counter()
    texts: dict[int, list[str]] = {}
    finals = {}
    while engine.has_work():
        for output in engine.step():
            texts.setdefault(output.index, []).append(output.text)
            if output.finished:
                finals[output.index] = output
    for index in sorted(finals):
        final = finals[index]
        score = f", score {final.score:.4f}" if final.score is not None else ""
        logprob = final.cumulative_logprob
        print(
            f"--- output {index}: {final.completion_tokens} tokens, "
            f"cumulative logprob {logprob:.4f}{score}, finish reason: "
            f"{final.finish_reason.value} ---"
        )
        print("".join(texts[index]))
    print(f"[{len(finals)} outputs in {time.perf_counter() - start:.2f} s]", file=sys.stderr)
    return exit_status.OK
