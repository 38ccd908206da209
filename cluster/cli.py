"""The ``tessera`` command line: ``generate``, ``cluster``, ``serve`` and ``bench serve``.

This module builds the parser and turns each command's flags into its settings (a bad
one exits with its message, naming the flag or field); each command runs from its own
module (``cli_generate``, ``cli_cluster``, ``server``), imported when it runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing

# Only what the parser needs is imported here: `tessera --help` must not load torch.
from tessera.cluster import exit_status
from tessera.cluster.cli_bench import add_bench_serve_arguments
from tessera.cluster.cli_sampling import early_stopping, sampling_from_args
from tessera.cluster.flags import add_config_arguments, add_engine_arguments
from tessera.cluster.serve_config import ServeConfig
from tessera.workers.api import PARALLEL_MODES, SPECULATIVE_METHODS

if typing.TYPE_CHECKING:
    from tessera.workers.config import EngineConfig

#: Settings that ``tessera generate`` gives its one request rather than the engine: a
#: bad combination gets the request's error message.
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
    """``tessera generate``'s old spellings of three of its flags."""
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
    from tessera.cluster.flags import engine_config_from_args
    from tessera.workers.config import EngineConfig

    defaults = EngineConfig()  # REQUEST_SETTINGS keep these: the request carries them
    return engine_config_from_args(
        args, **{name: getattr(defaults, name) for name in REQUEST_SETTINGS}
    )


def _generate(args: argparse.Namespace) -> int:
    from tessera.cluster.cli_generate import generate  # the engine (torch)
    from tessera.workers.api import InvalidRequestError

    try:
        sampling = sampling_from_args(args)
        config = _engine_config(args)
    except (InvalidRequestError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_status.USAGE
    return generate(args, sampling, config)


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
        type=early_stopping,
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

    bench = commands.add_parser(
        "bench",
        help="benchmark a server",
        description="Benchmarks; `tessera bench serve --help` for the serving one.",
    )
    benches = bench.add_subparsers(dest="bench", required=True)
    load = benches.add_parser(
        "serve",
        help="load any OpenAI-compatible server and report TTFT, TPOT, ITL, throughput",
        description="Send --num-prompts streaming requests to an OpenAI-compatible server "
        "(Tessera, vLLM, or any other) at --request-rate and at most --max-concurrency "
        "at once, then print the summary as `vllm bench serve` does: throughputs, goodput "
        "and the mean, median and percentiles of TTFT, TPOT, ITL and end-to-end latency, "
        "timed on this client. The same flags and --seed give two servers the same "
        "prompts and arrival times. --save-result writes the numbers as JSON and a PNG "
        "of the latencies (with matplotlib: pip install 'tessera[bench]'). Bad options "
        "or dataset files exit with status 2, naming the option or line; a server that "
        "does not answer, or answers no request, with status 1.",
    )
    add_bench_serve_arguments(load)
    load.set_defaults(func=_bench_serve)
    return parser


def _bench_serve(args: argparse.Namespace) -> int:
    from tessera.cluster.cli_bench import run_bench_serve

    return run_bench_serve(args)


def _serve(args: argparse.Namespace) -> int:
    from tessera.cluster.cluster_config import ConfigError
    from tessera.cluster.flags import config_from_args
    from tessera.cluster.serve_config import load_config_file
    from tessera.cluster.server import run_server

    try:
        base = load_config_file(args.config) if args.config else {}
        config = config_from_args(args, ServeConfig, base)
        return run_server(config, args.log_level)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_status.USAGE
    except KeyboardInterrupt:
        return exit_status.INTERRUPTED


def _cluster(args: argparse.Namespace) -> int:
    import asyncio

    from tessera.cluster.cli_cluster import run_cluster  # Ray
    from tessera.cluster.cluster_config import ConfigError
    from tessera.cluster.flags import config_from_args
    from tessera.workers.api import InvalidRequestError

    try:
        config = config_from_args(args)
        sampling = sampling_from_args(args, nested=False)
    except (ConfigError, InvalidRequestError) as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_status.USAGE
    try:
        return asyncio.run(run_cluster(config, sampling, args))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return exit_status.USAGE
    except KeyboardInterrupt:
        return exit_status.INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
