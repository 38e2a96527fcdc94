"""``pdcluster bench prefix``: multi-turn conversations that share a system prompt, over
several prefill replicas, once per prefill routing policy (``router.routing.prefill``), each
on a cluster of its own started for it, same machine, same run.

``--chats`` conversations (8) of ``--turns`` turns (4) run side by side, each turn sent when
the chat's previous answer is in (the answer joins the next turn's messages, so each prompt
extends the previous one). Per policy it prints:

- cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``) against the ideal:
  each prompt finding in cache the longest prefix it shares with any prompt sent before it
  (its whole previous turn, and the system prompt), in whole blocks, never its last token;
- the prompt tokens each prefill replica computed (its engine's counter), as shares: a
  router that sends everything to one replica serves nothing from the other;
- TTFT p50 / p90 (client side, streamed; a 429 is waited out as its Retry-After says and
  the turn sent again, the wait counted in its TTFT) and the routing decisions by reason.

The baselines: ``least_loaded`` (the cache ignored) and ``first_block_hash`` (the policy
before the index: a hash of the prompt's first block picks the replica).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.serve_bench import _percentiles

SYSTEM_PROMPT = (
    "You are the support assistant of a company that runs large language model serving "
    "clusters. Answer in one or two short sentences, plainly, without lists. If a question "
    "is about prices, say that the sales team answers those. If a question is about an "
    "outage, ask for the cluster's name and the time it started. Never invent numbers. "
    "Prefer the words the user used. Be kind, and do not apologise more than once."
)
QUESTIONS = [
    "How do I add a node to my cluster?",
    "Why is the first token slow?",
    "What does the decode pool do?",
    "Can I move KV between nodes?",
    "How much does a GPU cost?",
    "My cluster is down, help!",
    "What is a prefix cache?",
    "How do I scale prefill on its own?",
    "What happens when a node dies?",
    "Which models can I serve?",
]
FOLLOW_UPS = ["Tell me more.", "Why?", "And then what?", "Can you give an example?"]
POLICIES = ("least_loaded", "first_block_hash", "kv_aware")
MAX_TRIES = 10


@dataclass
class Turn:
    prompt_ids: list[int]
    cached: int
    sent_at: float
    first_at: float  # its first token: its prompt is in a prefill replica's cache from then
    answer: str

    @property
    def ttft_s(self) -> float:
        return self.first_at - self.sent_at


@dataclass
class PolicyRun:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    computed: dict[str, int] = field(default_factory=dict)  # prefill replica → prompt tokens
    routing: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    refusals: int = 0  # 429s, each waited out and sent again


class Refused(RuntimeError):
    """A 429: the client waits ``retry_after_s`` and sends the turn again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


async def _turn(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> Turn:
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first = None
    text: list[str] = []
    prompt_ids: list[int] = []
    cached = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code == 429:
            retry = float(resp.headers.get("Retry-After", "1"))
            raise Refused(f"HTTP 429: {(await resp.aread())[:300]!r}", retry)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:300])
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            if chunk.get("usage"):
                cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    if first is None:
        raise RuntimeError("no tokens")
    return Turn(prompt_ids, cached, start, first, "".join(text))


async def _chat(url: str, index: int, turns: int, max_tokens: int, run: PolicyRun) -> None:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for turn in range(turns):
            question = QUESTIONS[index % len(QUESTIONS)] if turn == 0 else FOLLOW_UPS[turn - 1]
            messages.append({"role": "user", "content": question})
            sent_at = time.perf_counter()
            for _ in range(MAX_TRIES):
                try:
                    done = await _turn(client, messages, max_tokens)
                    break
                except Refused as err:  # as a client of a 429 does: wait, send it again
                    run.refusals += 1
                    await asyncio.sleep(err.retry_after_s)
                except (RuntimeError, httpx.HTTPError) as err:
                    run.errors.append(f"chat {index} turn {turn}: {type(err).__name__}: {err}")
                    return
            else:
                run.errors.append(f"chat {index} turn {turn}: refused {MAX_TRIES} times")
                return
            done.sent_at = sent_at  # its TTFT counts the waits after a refusal
            run.turns.append(done)
            messages.append({"role": "assistant", "content": done.answer})


def _prefill_counters(running) -> dict[str, tuple[int, int]]:
    import ray

    workers = {n: h for n, h in running.workers().items() if n.startswith("prefill-")}
    stats = ray.get([h.stats.remote() for h in workers.values()])
    return {
        n: (s.load.prompt_tokens_computed, s.load.prefix_hit_tokens)
        for n, s in zip(workers, stats, strict=True)
    }


def run_policy(
    policy: str, model: str | None, chats: int, turns: int, max_tokens: int, prefill: int
) -> PolicyRun:
    import ray

    from cluster.config import ClusterConfig
    from cluster.launcher import start_cluster, stop_cluster

    data: dict = {
        "pools": {"prefill": {"replicas": prefill}, "decode": {"replicas": 1}},
        "router": {"port": 0, "grpc_port": None, "routing": {"prefill": policy}},
    }
    if model is not None:
        data["model"] = model
    running = start_cluster(ClusterConfig.from_dict(data))
    run = PolicyRun(policy)
    try:
        before = _prefill_counters(running)

        async def main() -> None:
            url = running.urls["http"]
            await asyncio.gather(*(_chat(url, i, turns, max_tokens, run) for i in range(chats)))

        asyncio.run(main())
        time.sleep(1.0)  # the router's next read of the replicas' stats
        after = _prefill_counters(running)
        run.computed = {n: after[n][0] - before.get(n, (0, 0))[0] for n in after}
        router = ray.get_actor("router", namespace=running.config.namespace)
        stats = ray.get(router.backend_stats.remote())
        run.routing = dict(stats.get("prefill_routing") or {})
    finally:
        stop_cluster(running)
    return run


def ideal_cached(turns: list[Turn], block_size: int) -> int:
    """Each prompt's longest shared prefix with any prompt sent before it, in whole blocks,
    never its last token: every turn finding its whole previous prompt, and the system
    prompt found by all but the first request (what a cache holding everything serves)."""
    total = 0
    for turn in turns:
        best = 0
        for earlier in (t for t in turns if t.sent_at < turn.sent_at):
            shared = 0
            for a, b in zip(turn.prompt_ids, earlier.prompt_ids, strict=False):
                if a != b:
                    break
                shared += 1
            best = max(best, shared)
        total += min(best, len(turn.prompt_ids) - 1) // block_size * block_size
    return total


def summarize(run: PolicyRun, block_size: int) -> dict:
    prompt_tokens = sum(len(t.prompt_ids) for t in run.turns)
    cached = sum(t.cached for t in run.turns)
    ideal = ideal_cached(run.turns, block_size)
    computed = sum(run.computed.values())
    ttft = _percentiles([t.ttft_s for t in run.turns])
    return {
        "policy": run.policy,
        "requests": len(run.turns),
        "errors": len(run.errors),
        "refusals": run.refusals,
        "error_messages": run.errors,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "ideal_cached_tokens": ideal,
        "cached_of_ideal": cached / ideal if ideal else None,
        "computed_by_replica": run.computed,
        "largest_share": max(run.computed.values()) / computed if computed else None,
        "ttft_p50_ms": None if ttft["p50"] is None else ttft["p50"] * 1000,
        "ttft_p90_ms": None if ttft["p90"] is None else ttft["p90"] * 1000,
        "routing": run.routing,
    }


def format_summary(rows: list[dict]) -> str:
    lines = [
        f"{'policy':<18}{'cached/ideal':>14}{'cached':>8}{'ideal':>7}{'largest share':>15}"
        f"{'TTFT p50':>10}{'p90':>8}  routing"
    ]
    for r in rows:
        share = "-" if r["largest_share"] is None else f"{r['largest_share']:.0%}"
        of_ideal = "-" if r["cached_of_ideal"] is None else f"{r['cached_of_ideal']:.0%}"
        lines.append(
            f"{r['policy']:<18}{of_ideal:>14}{r['cached_tokens']:>8}{r['ideal_cached_tokens']:>7}"
            f"{share:>15}{r['ttft_p50_ms']:>8.1f}ms{r['ttft_p90_ms']:>6.1f}ms  "
            f"{r['routing']}  computed {r['computed_by_replica']}"
            + (f"  429s {r['refusals']}" if r["refusals"] else "")
            + (f"  errors {r['errors']}" if r["errors"] else "")
        )
    return "\n".join(lines)


def add_prefix_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "prefix",
        help="multi-turn chats sharing a system prompt, per prefill routing policy",
    )
    p.add_argument("--model", default=None, help="model to serve (default: the default model)")
    p.add_argument("--chats", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prefill-replicas", type=int, default=2)
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated (default {','.join(POLICIES)})",
    )
    p.add_argument("--json-out", help="also write the rows as JSON")
    p.set_defaults(func=run_prefix_cli)


def run_prefix_cli(args) -> int:
    from cluster.ray_env import prepare_ray_environment

    prepare_ray_environment(None)
    if args.turns > len(FOLLOW_UPS) + 1:
        raise SystemExit(f"--turns: at most {len(FOLLOW_UPS) + 1}")
    rows = []
    for policy in args.policies.split(","):
        if policy not in POLICIES:
            raise SystemExit(f"--policies: {policy!r} is not one of {', '.join(POLICIES)}")
        run = run_policy(
            policy, args.model, args.chats, args.turns, args.max_tokens, args.prefill_replicas
        )
        rows.append(summarize(run, block_size=16))
        print(format_summary(rows[-1:]), flush=True)
    print()
    print(format_summary(rows))
    for row in rows:
        for message in row["error_messages"]:
            print(f"{row['policy']}: {message}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["errors"] == 0 for r in rows) else 1
