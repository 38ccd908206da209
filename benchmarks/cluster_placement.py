"""Cluster placement: prefix affinity vs round robin on a multi-tenant workload, 2 workers.

Eight tenants each have their own system prompt (``--system-len`` tokens of distinct
instructions); each sends ``--per-tenant`` requests, its system prompt followed by its
own short question. All requests are submitted in one shuffled order (fixed ``--seed``)
with at most ``--concurrency`` in flight, decoded greedily for ``--new`` tokens with EOS
ignored. For each policy a fresh two-worker cluster is started (cold prefix caches on
both sides; one CPU and one torch thread per worker), its workers' runtime is warmed
up with unrelated prompts (spread by round robin), then the workload runs. The peer is
round robin; prefix affinity is the cluster's default policy.

This runs for each KV pool size in ``--kv-blocks`` (per worker): 512 blocks hold every
tenant's prefix on each worker (round robin only pays one cold prefill per tenant and
worker), 144 hold about half of them (round robin's workers, which see every tenant,
must evict; affinity's, which see about half the tenants each, need not).

Measured per policy: the prefix-cache hit rate over the run (prompt tokens found
cached / prompt tokens looked up, summed over both workers, from the workers' load
reports), time to first token per request (from ``submit`` to its first delta carrying
token ids; mean, p50, p90), throughput (generated tokens / wall time of the run), how
requests and tenants spread over the workers (``off_home``: requests placed away from
the worker their tenant's first request went to) and the engines' preemptions.
Outputs must be token-identical between the policies and pool sizes. With
``--repeats`` > 1 the policies alternate (each repeat on fresh clusters) and the
medians are reported.

    python benchmarks/cluster_placement.py --tenants 8 --per-tenant 16 --concurrency 16 \
        --kv-blocks 512 144
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from benchmarks.common import paired_panel, report, run_on_local_ray, side_panels  # noqa: E402
from tessera.cluster.config import ClusterConfig  # noqa: E402
from tessera.cluster.launch import Cluster  # noqa: E402
from tessera.workers.api import SamplingParams  # noqa: E402
from tessera.workers.model.loader import load_tokenizer  # noqa: E402
from tessera.workers.process.protocol import WorkerLoad  # noqa: E402

NAMESPACE = "tessera-bench-placement"
POLICIES = ("prefix_affinity", "round_robin")  # ours, the peer
TENANTS = [
    "You are the support assistant of Northwind Parcels, a shipping company. Answer "
    "questions about parcels, delivery windows, customs declarations, lost items and "
    "returns. Always ask for the tracking number before discussing a specific parcel, "
    "never invent one, and never promise a delivery date that the tracking system does "
    "not show. Parcels over thirty kilograms travel as freight and need a booking made "
    "two days ahead. Refunds for lost parcels take ten working days. ",
    "You are the virtual receptionist of Riverside Family Clinic. You book, move and "
    "cancel appointments with the clinic's six doctors, explain which documents a new "
    "patient must bring, and describe the clinic's opening hours. You never give medical "
    "advice: for any symptom, tell the patient to call the nurse line or, in an "
    "emergency, the emergency number. Vaccination days are Tuesday and Thursday "
    "mornings, and blood tests need an appointment before nine o'clock. ",
    "You are Chef Ana, the cooking assistant of the Green Pantry recipe website. Suggest "
    "vegetarian recipes from the site's collection, adapt quantities to the number of "
    "guests, propose substitutions for missing ingredients and explain techniques step "
    "by step. Mention the preparation time and the difficulty of every recipe. Warn "
    "about common allergens such as nuts, gluten and sesame, and never suggest meat or "
    "fish, even when the visitor asks for it. ",
    "You are the helpdesk bot of Kestrel Software, which sells an accounting program for "
    "small firms. Help users install and update the program, restore backups, connect "
    "their bank accounts and fix error codes. Ask for the version number and the "
    "operating system first. Licence questions go to the sales team, and you must never "
    "ask for or repeat a password. Known issue: error E-417 after the March update is "
    "fixed by clearing the local cache from the settings page. ",
    "You are the travel adviser of Bluewave Holidays. Help customers choose between the "
    "agency's package trips to Portugal, Greece, Norway and Japan, explain what each "
    "package includes, and describe the booking, payment and cancellation rules. A "
    "deposit of twenty percent secures a booking; cancellations more than sixty days "
    "before departure are free. Recommend travel insurance but never sell it yourself, "
    "and always mention the visa rules for Japan. ",
    "You are the information assistant of the Lakeside City Transit authority. Answer "
    "questions about bus and tram routes, timetables, fares, season passes, lost "
    "property and accessibility. Night buses run on Friday and Saturday only. Children "
    "under six travel free, students pay half price with a valid card, and bicycles are "
    "allowed on trams outside rush hours. Never guess a departure time: point the "
    "traveller to the live timetable in the app instead. ",
    "You are the student services assistant of Hillcrest College. Explain enrolment "
    "deadlines, course registration, tuition payment plans, library access, exam "
    "timetables and the appeals procedure. Scholarships are awarded in September and "
    "February. Students on a payment plan must pay the first instalment before classes "
    "start. Refer personal or health matters to the counselling office, and never "
    "disclose another student's grades or contact details. ",
    "You are the customer assistant of Harbor Savings Bank. Explain the bank's current "
    "and savings accounts, card fees, transfer limits and the mobile app. You cannot see "
    "balances or move money; for anything about a customer's own account, direct them "
    "to log in to online banking or call the branch. Warn customers that the bank never "
    "asks for a PIN by phone or e-mail, and report suspected fraud at once through the "
    "card-blocking line, which is open day and night. ",
]
QUESTIONS = [
    "What are your opening hours on Sundays?",
    "How can I change what I booked last week?",
    "Is there a fee if I cancel at short notice?",
    "Can you explain the rules in simple words?",
    "What should I prepare before I contact you again?",
    "Do you offer anything special for students?",
    "My friend had a problem yesterday; what can she do?",
    "How long does it usually take to get an answer?",
    "Can I do this online instead of coming in person?",
    "What happens if I miss the deadline?",
    "Which option would you recommend for a beginner?",
    "Who should I call if something goes wrong at night?",
    "Is there a discount for families or groups?",
    "What documents do I need to bring?",
    "Can you summarise the most important rule for me?",
    "Where can I leave feedback about my experience?",
]


def system_prompt(tokenizer, text: str, length: int) -> list[int]:
    """``length`` tokens of the tenant's instructions (repeated if they are shorter)."""
    full = text
    while len(tokenizer(full).input_ids) < length:
        full += "To repeat the instructions: " + text
    return tokenizer(full).input_ids[:length]


def workload(tokenizer, args) -> list[tuple[str, int, list[int]]]:
    """(request id, tenant, prompt token ids), in the shuffled submission order."""
    requests = []
    for tenant, text in enumerate(TENANTS[: args.tenants]):
        system = system_prompt(tokenizer, text, args.system_len)
        for j in range(args.per_tenant):
            question = f" User (ticket {tenant}-{j}): {QUESTIONS[j % len(QUESTIONS)]} Assistant:"
            requests.append((f"t{tenant}-q{j}", tenant, system + tokenizer(question).input_ids))
    random.Random(args.seed).shuffle(requests)
    return requests


async def settle(cluster: Cluster, generated: int, before=None):
    """Wait until no request is placed and the workers' reports account for every token
    generated since ``before`` (since they started, if None); return those stats."""
    deadline = time.monotonic() + 60
    while True:
        stats = await cluster.stats()
        reported = all(w.load is not None for w in stats.workers)
        done = reported and not any(w.ongoing for w in stats.workers)
        if done and _delta(stats, before, lambda load: load.engine.generated_tokens) >= generated:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers' reports did not catch up: {stats}")
        await asyncio.sleep(cluster.config.report_interval_s)


def _delta(after, before, figure: Callable[[WorkerLoad], int]) -> int:
    """``figure`` of the workers' loads summed, minus its value in ``before``."""
    old = {w.worker_id: figure(w.load) for w in before.workers} if before else {}
    return sum(figure(w.load) - old.get(w.worker_id, 0) for w in after.workers)


async def warm_up(cluster: Cluster, tokenizer, workers: int) -> int:
    """Run the workers' first (slow) forward passes on prompts no tenant shares:
    round robin gives each worker two concurrent requests."""
    policy = (await cluster.stats()).policy
    await cluster.scheduler.set_placement.remote("round_robin")
    text = "Count the rivers, mountains and gardens in this short letter. " * 6
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def one(i: int) -> None:
        ids = tokenizer(f"Warm-up {i}: {text}").input_ids
        async for _ in await cluster.submit(f"warm-{i}", ids, params):
            pass

    await asyncio.gather(*(one(i) for i in range(2 * workers)))
    await cluster.scheduler.set_placement.remote(policy)
    return 2 * workers * params.max_tokens


async def run_policy(args, policy: str, blocks: int, repeat: int, requests, tokenizer) -> dict:
    config = ClusterConfig.create(
        workers=2,
        placement=policy,
        device="cpu",
        dtype="float32",
        worker_num_cpus=1.0,
        num_kv_blocks=blocks,
        max_num_seqs=args.max_num_seqs,
        max_ongoing_requests=args.max_num_seqs,
        namespace=NAMESPACE,
        # A name per cluster: a fresh scheduler, never the one just shut down.
        scheduler_name=f"bench-{policy}-{blocks}-{repeat}",
    )
    started = time.perf_counter()
    cluster = await Cluster.start(config)
    label = f"{policy}, {blocks} blocks/worker, #{repeat}"
    print(f"{label}: cluster up in {time.perf_counter() - started:.1f} s", flush=True)
    try:
        # The baseline: reports that include the warm-up's every token.
        before = await settle(cluster, await warm_up(cluster, tokenizer, 2))
        preempted = -await preemptions(cluster)
        params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
        ttft: dict[str, float] = {}
        tokens: dict[str, list[int]] = {}
        worker_of: dict[str, str] = {}
        order = iter(requests)

        async def client() -> None:
            for request_id, _, prompt in order:
                submitted = time.perf_counter()
                stream = await cluster.submit(request_id, prompt, params)
                # The client's record of where the scheduler placed it (for the spread).
                worker_of[request_id] = cluster.client.placement(request_id).worker_id
                out = tokens[request_id] = []
                async for delta in stream:
                    if delta.token_ids and request_id not in ttft:
                        ttft[request_id] = time.perf_counter() - submitted
                    out.extend(delta.token_ids)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
        generated = sum(len(t) for t in tokens.values())
        after = await settle(cluster, generated, before)
        preempted += await preemptions(cluster)
    finally:
        await cluster.shutdown()

    assert all(len(t) == args.new for t in tokens.values()), "a request came back short"
    queries = _delta(after, before, lambda load: load.engine.prefix_cache.queries)
    hits = _delta(after, before, lambda load: load.engine.prefix_cache.hits)
    workers = sorted(w.worker_id for w in after.workers)
    old = {w.worker_id: w.placed for w in before.workers}
    placed = {w.worker_id: w.placed - old.get(w.worker_id, 0) for w in after.workers}
    tenants = {
        worker: sorted({t for rid, t, _ in requests if worker_of[rid] == worker})
        for worker in workers
    }
    # A tenant's "home": the worker its first request went to.
    home: dict[int, str] = {}
    for request_id, tenant, _ in requests:
        home.setdefault(tenant, worker_of[request_id])
    times = sorted(ttft.values())
    result = {
        "hit_rate": hits / queries if queries else 0.0,
        "mean_ttft_s": statistics.fmean(times),
        "p50_ttft_s": statistics.median(times),
        "p90_ttft_s": statistics.quantiles(times, n=10)[8],
        "throughput_tok_s": generated / wall,
        "wall_s": wall,
        "prompt_tokens_computed": queries - hits,
        "placed": "/".join(str(placed[w]) for w in workers),
        "tenants_per_worker": "/".join(str(len(tenants[w])) for w in workers),
        "off_home": sum(worker_of[rid] != home[t] for rid, t, _ in requests),
        "preemptions": preempted,
        "tenant_split": {w: tenants[w] for w in workers},
        "tokens": tokens,
    }
    print(
        f"{label}: hit rate {result['hit_rate']:.3f}, mean TTFT {result['mean_ttft_s']:.3f} s, "
        f"p90 {result['p90_ttft_s']:.3f} s, {result['throughput_tok_s']:.1f} tok/s, placed "
        f"{result['placed']}, tenants {result['tenant_split']}, off home {result['off_home']}",
        flush=True,
    )
    return result


async def preemptions(cluster: Cluster) -> int:
    """Preemptions so far, summed over the workers' engines (not in the load reports)."""
    total = 0
    for worker in (await cluster.stats()).workers:
        handle = await cluster.scheduler.worker_handle.remote(worker.worker_id)
        total += (await handle.engine_stats.remote()).preemptions
    return total


METRICS = (
    "hit_rate",
    "mean_ttft_s",
    "p50_ttft_s",
    "p90_ttft_s",
    "throughput_tok_s",
    "wall_s",
    "prompt_tokens_computed",
    "off_home",
    "preemptions",
)


async def bench(args) -> None:
    tokenizer = load_tokenizer(None)
    requests = workload(tokenizer, args)
    runs: dict[tuple[int, str], list[dict]] = {
        (blocks, policy): [] for blocks in args.kv_blocks for policy in POLICIES
    }
    for repeat in range(args.repeats):
        for blocks in args.kv_blocks:
            # Alternate which policy runs first: this machine's speed drifts over minutes.
            order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
            for policy in order:
                result = await run_policy(args, policy, blocks, repeat, requests, tokenizer)
                runs[blocks, policy].append(result)

    reference = runs[args.kv_blocks[0], "round_robin"][0]["tokens"]
    same = all(run["tokens"] == reference for group in runs.values() for run in group)
    rows = []
    for blocks in args.kv_blocks:
        medians = {
            policy: {
                key: statistics.median(run[key] for run in runs[blocks, policy]) for key in METRICS
            }
            for policy in POLICIES
        }
        peer = medians["round_robin"]
        for policy in POLICIES:
            m = medians[policy]
            rows.append(
                {
                    "kv_blocks": blocks,
                    "policy": policy,
                    "hit_rate": m["hit_rate"],
                    "mean_ttft_s": m["mean_ttft_s"],
                    "p50_ttft_s": m["p50_ttft_s"],
                    "p90_ttft_s": m["p90_ttft_s"],
                    "throughput_tok_s": m["throughput_tok_s"],
                    "prompt_tokens_computed": int(m["prompt_tokens_computed"]),
                    "placed": runs[blocks, policy][0]["placed"],
                    "tenants_per_worker": runs[blocks, policy][0]["tenants_per_worker"],
                    "off_home": int(m["off_home"]),
                    "preemptions": int(m["preemptions"]),
                    "hit_rate_ratio": m["hit_rate"] / peer["hit_rate"],
                    "mean_ttft_ratio": m["mean_ttft_s"] / peer["mean_ttft_s"],
                    "p90_ttft_ratio": m["p90_ttft_s"] / peer["p90_ttft_s"],
                    "throughput_ratio": m["throughput_tok_s"] / peer["throughput_tok_s"],
                    "same_outputs": same,
                }
            )
    print(f"outputs token-identical across policies and pools: {same}", flush=True)

    def plot(ax):
        ax.figure.set_size_inches(12, 4.5)
        ttft_ax, hit_ax, tput_ax = side_panels(ax, [2, 1, 1])
        ours = [r for r in rows if r["policy"] == POLICIES[0]]
        theirs = [r for r in rows if r["policy"] == POLICIES[1]]
        names = ("prefix affinity", "round robin")
        pools = [f"{r['kv_blocks']} blocks" for r in ours]
        labels = [f"{k} TTFT\n{pool}" for pool in pools for k in ("mean", "p90")]
        keys = ("mean_ttft_s", "p90_ttft_s")
        pairs = [(a, b, k) for a, b in zip(ours, theirs, strict=True) for k in keys]
        paired_panel(
            ttft_ax,
            labels,
            [a[k] for a, _, k in pairs],
            [b[k] for _, b, k in pairs],
            names,
            [a[k] / b[k] for a, b, k in pairs],
            "time to first token (s)",
            legend=True,
        )
        for panel, key, scale, ylabel in (
            (hit_ax, "hit_rate", 100, "prefix-cache hit rate (%)"),
            (tput_ax, "throughput_tok_s", 1, "generated tokens / s"),
        ):
            paired_panel(
                panel,
                pools,
                [scale * r[key] for r in ours],
                [scale * r[key] for r in theirs],
                names,
                [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)],
                ylabel,
            )
        fig = ax.figure
        fig.suptitle(
            f"{args.tenants} tenants x {args.per_tenant} requests, {args.concurrency} in "
            f"flight, 2 workers (KV blocks per worker below); outputs identical: {same}",
            fontsize=9,
        )

    report(
        "cluster_placement" + ("_quick" if args.quick else ""),
        rows,
        {
            "peer": "round-robin placement on the same two-worker cluster setup "
            "(a fresh cluster per policy, pool size and repeat)",
            "workers": 2,
            "worker_num_cpus": 1.0,
            "tenants": args.tenants,
            "requests_per_tenant": args.per_tenant,
            "system_prompt_tokens": args.system_len,
            "prompt_tokens": [len(p) for _, _, p in requests],
            "new_tokens": args.new,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "kv_blocks_per_worker": args.kv_blocks,
            "block_size": ClusterConfig().block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_ongoing_requests": args.max_num_seqs,
            "report_interval_s": ClusterConfig().report_interval_s,
            "repeats": args.repeats,
            "dtype": "float32",
            "quick": args.quick,
            "same_outputs": same,
            "runs": {
                f"{policy}_{blocks}": [
                    {k: v for k, v in run.items() if k != "tokens"} for run in group
                ]
                for (blocks, policy), group in runs.items()
            },
        },
        plot,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=8, choices=range(1, len(TENANTS) + 1))
    parser.add_argument("--per-tenant", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=300)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="of the submission order")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        nargs="+",
        default=[512, 144],
        help="KV pool sizes per worker to run, each with both policies (512: every "
        "tenant's prefix fits on each worker; 144: about half of them do)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=16, help="per worker")
    parser.add_argument("--repeats", type=int, default=1, help="fresh clusters per policy")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.tenants, args.per_tenant, args.system_len, args.new = 2, 4, 64, 4
        args.kv_blocks = args.kv_blocks[:1]
    run_on_local_ray(bench(args), num_cpus=2, namespace=NAMESPACE)


if __name__ == "__main__":
    main()
