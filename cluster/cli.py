"""The ``tessera`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import typing
from pathlib import Path

# Only what the parser needs is imported here: `tessera --help` must not load torch.
from tessera.cluster.config import ServeConfig, add_config_arguments, add_engine_arguments
from tessera.workers.api import PARALLEL_MODES, SPECULATIVE_METHODS

if typing.TYPE_CHECKING:
    from tessera.workers.api import SamplingParams
    from tessera.workers.config import EngineConfig

#: Settings that ``tessera generate`` gives its one request rather than the engine (as
#: before the flags were derived): a bad combination gets the request's error message.
REQUEST_SETTINGS = ("speculative_method", "speculative_num_tokens")


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag, kept for one release: it sets the new flag's value and
    warns on stderr, naming the new flag."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs) -> None:
        kwargs.setdefault("help", f"deprecated spelling of {new_flag}")
        kwargs["default"] = argparse.SUPPRESS  # the new flag's default stands
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            f"warning: {option_string} is deprecated and will be removed in the next "
            f"release; use {self.new_flag}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _add_deprecated_aliases(parser: argparse.ArgumentParser) -> None:
    """``tessera generate``'s spellings before its engine flags were derived."""
    group = parser.add_argument_group("deprecated spellings (removed in the next release)")
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action=DeprecatedAlias,
        new_flag="--no-enable-prefix-caching",
        nargs=0,
        const=False,
    )
    group.add_argument(
        "--speculative",
        dest="speculative_method",
        action=DeprecatedAlias,
        new_flag="--speculative-method",
        choices=SPECULATIVE_METHODS,
    )
    group.add_argument(
        "--num-speculative-tokens",
        dest="speculative_num_tokens",
        action=DeprecatedAlias,
        new_flag="--speculative-num-tokens",
        type=int,
    )


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    from tessera.cluster.config import engine_config_from_args
    from tessera.workers.config import EngineConfig

    defaults = EngineConfig()  # REQUEST_SETTINGS keep these: the request carries them
    return engine_config_from_args(
        args, **{name: getattr(defaults, name) for name in REQUEST_SETTINGS}
    )


def _early_stopping(text: str) -> bool | str:
    value = {"true": True, "false": False, "never": "never"}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"must be true, false or never, got {text!r}")
    return value


def _sampling(args: argparse.Namespace, nested: bool = True) -> SamplingParams:
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
    structured = _structured(args)
    if structured is not None:
        values["structured"] = structured
    return sampling_params(values)


def _structured(args: argparse.Namespace) -> dict[str, str] | None:
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


def _generate(args: argparse.Namespace) -> int:
    from tessera.workers.api import InvalidRequestError
    from tessera.workers.config import PRECISION_TEXT
    from tessera.workers.engine.engine import Engine

    try:
        sampling = _sampling(args)
        config = _engine_config(args)
    except (InvalidRequestError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("loading model ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        engine = Engine(config)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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
        return 2
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
    return 0


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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Tessera: an LLM serving cluster with a paged KV cache, continuous "
        "batching and block sharing.",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="generate a completion for one prompt and stream it",
        description="Load the model, generate a completion for --prompt and stream it to "
        "stdout (timing on stderr). Greedy when --temperature is 0.",
    )
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the model's chat template as a user message",
    )
    shape = gen.add_argument_group(
        "structured outputs", "the output follows one of these (every token is masked to it)"
    )
    shape.add_argument("--json-schema", metavar="FILE", help="a JSON schema file")
    shape.add_argument("--regex", help="a regular expression")
    shape.add_argument("--choice", nargs="+", metavar="TEXT", help="one of these strings")
    shape.add_argument("--grammar", metavar="FILE", help="a Lark or GBNF grammar file")
    gen.add_argument(
        "--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default: 0)",
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose "
        "probability sums to P (default: 1.0, off)",
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="keep only the K most likely tokens (default: -1, off)",
    )
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for sampling; the same seed gives the same text",
    )
    gen.add_argument(
        "--stop",
        action="append",
        help="stop when this string appears (repeatable); it is not printed",
    )
    gen.add_argument(
        "--n",
        type=int,
        default=1,
        help="how many completions to return; they share the prompt's KV blocks, and "
        "completion i samples with seed + i (default: 1)",
    )
    gen.add_argument(
        "--best-of",
        type=int,
        default=None,
        help="sample this many and return the --n with the highest cumulative logprob",
    )
    gen.add_argument(
        "--beam-width",
        type=int,
        default=1,
        help="beam search with this many beams, returning the --n best (default: 1, off)",
    )
    gen.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        help="beam search: score = logprob sum / length ** this (default: 1.0)",
    )
    gen.add_argument(
        "--early-stopping",
        type=_early_stopping,
        default=False,
        help="beam search: true stops at --beam-width finished beams, false when no "
        "running beam can win, never runs the canonical search (default: false)",
    )
    spec = gen.add_argument_group("several tokens per step")
    spec.add_argument(
        "--parallel-tokens",
        type=float,
        default=None,
        metavar="THRESHOLD",
        help="parallel tokens (TEMPO): also append every token at least this probable at "
        "the same position; the output shows each set as [a|b|c] (default: off)",
    )
    spec.add_argument(
        "--parallel-max-width",
        type=int,
        default=4,
        help="most tokens in one parallel set (default: 4)",
    )
    spec.add_argument(
        "--parallel-mode",
        choices=PARALLEL_MODES,
        default="isolated",
        help="isolated: each token of a set sees the context and itself; visible: also "
        "the rest of its set (default: isolated)",
    )
    add_engine_arguments(gen)
    _add_deprecated_aliases(gen)
    gen.set_defaults(func=_generate)

    clu = commands.add_parser(
        "cluster",
        help="start a cluster (scheduler + worker actors on Ray); run prompts or stay up",
        description="Start or join a Ray cluster, start the scheduler actor and its workers "
        "from the flags below, and wait until they are healthy. With --prompt, run each "
        "prompt through the cluster (concurrently), print the completions and where they "
        "ran, then stop. Without, stay up and print each worker's load every "
        "--stats-interval seconds until Ctrl-C. Bad flags fail at once, naming the field.",
    )
    clu.add_argument(
        "--prompt", action="append", help="a prompt to complete (repeatable); none: stay up"
    )
    clu.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    clu.add_argument(
        "--max-tokens", type=int, default=64, help="most tokens per completion (default: 64)"
    )
    clu.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    clu.add_argument("--seed", type=int, default=None, help="sampling seed")
    clu.add_argument(
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between load lines while the cluster stays up (default: 10)",
    )
    add_config_arguments(clu, only_given=True)
    clu.set_defaults(func=_cluster)

    srv = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API (Ray Serve)",
        description="Start or join a Ray cluster, start the scheduler and its workers, "
        "and serve POST /v1/completions, POST /v1/chat/completions, GET /v1/models, "
        "GET /health and GET /metrics on --host:--port (default 127.0.0.1:8000) until "
        "Ctrl-C, which drains ongoing requests and stops everything this command "
        "started. Settings come from the defaults, then --config FILE (YAML, the same "
        "keys as the flags with underscores: the schema the Helm chart renders), then "
        "the flags given. Bad settings fail at once, naming the field.",
    )
    srv.add_argument("--config", metavar="FILE", help="YAML file with any of the settings below")
    add_config_arguments(srv, ServeConfig, only_given=True)
    srv.set_defaults(func=_serve)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from tessera.cluster.config import ConfigError, config_from_args, load_config_file
    from tessera.cluster.server import run_server

    try:
        base = load_config_file(args.config) if args.config else {}
        config = config_from_args(args, ServeConfig, base)
        return run_server(config, args.log_level)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _cluster(args: argparse.Namespace) -> int:
    import asyncio

    from tessera.cluster.config import ConfigError, config_from_args
    from tessera.workers.api import InvalidRequestError

    try:
        config = config_from_args(args)
        sampling = _sampling(args, nested=False)
    except (ConfigError, InvalidRequestError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run_cluster(config, sampling, args))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


async def _run_cluster(config, sampling: SamplingParams, args: argparse.Namespace) -> int:
    import asyncio

    from tessera.cluster.launch import Cluster

    print("starting the cluster ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    cluster = await Cluster.start(config)
    try:
        stats = await cluster.stats()
        print(
            f"cluster ready in {time.perf_counter() - start:.1f} s: "
            f"{len(stats.workers)} workers, placement {stats.policy}, "
            f"{config.precision_text(cluster.worker_num_cpus, cluster.precision, cluster.device)}",
            file=sys.stderr,
            flush=True,
        )
        if not args.prompt:
            while True:
                await asyncio.sleep(args.stats_interval)
                _print_load(await cluster.stats())
        prompts = args.prompt
        if args.chat:
            template = cluster.client.tokenizer.apply_chat_template
            prompts = [
                template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in prompts
            ]

        async def complete(i: int, prompt: str) -> str:
            stream = await cluster.submit(f"cli-{i}", prompt, sampling)
            return "".join([delta.text async for delta in stream])

        texts = await asyncio.gather(*(complete(i, p) for i, p in enumerate(prompts)))
        for i, text in enumerate(texts):
            if len(texts) > 1:
                print(f"--- prompt {i} ---")
            print(text)
        _print_load(await cluster.stats())
        return 0
    finally:
        await cluster.shutdown()


def _print_load(stats) -> None:
    for worker in stats.workers:
        line = f"{worker.worker_id} {worker.status.value}: {worker.placed} placed"
        if worker.load is not None:
            engine = worker.load.engine
            cache = engine.prefix_cache
            line += (
                f", {worker.ongoing} ongoing, {engine.running} running, {engine.waiting} "
                f"waiting, KV {engine.kv_usage:.0%}, prefix hits {cache.hits}/{cache.queries} "
                f"tokens, step {engine.step_time * 1000:.0f} ms"
            )
        print(line, file=sys.stderr)
    print(
        f"queued {stats.queued}, placed {stats.placed}, refused {stats.refused}, "
        f"failovers {stats.failovers}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
