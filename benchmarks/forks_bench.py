"""n choices of one prompt against a running server: one request with ``n`` versus ``n``
requests of the same prompt sent at once (the same seeds), measured in the same run.

    python -m benchmarks.forks_bench [--url http://127.0.0.1:8000] [--n 4] [--rounds 5]

Prints, per way, the median time to the first token (of any choice) and to the last
choice's end, and the prefills and KV bytes the router counted (``pdcluster_prefills_total``,
``pdcluster_kv_transfer_bytes_total``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

COUNTERS = ("pdcluster_prefills_total", "pdcluster_kv_transfer_bytes_total")


def counters(url: str) -> list[float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line[:1] != "#"
    }
    return [values[name] for name in COUNTERS]


async def completion(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of one streamed completion."""
    started = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"{response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if line.startswith("data: {") and first is None:
                if any(c.get("text") for c in json.loads(line[6:])["choices"]):
                    first = time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--input-words", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    model = httpx.get(args.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(1)
    words = ["river", "stone", "lamp", "orbit", "salt", "maple", "cable", "harbor", "quiet"]
    results: dict[str, list[tuple[float, float]]] = {"one request, n": [], "n requests": []}
    counted = {way: [0.0, 0.0] for way in results}
    async with httpx.AsyncClient(timeout=300) as client:
        for round_ in range(args.rounds):
            # A fresh prompt per round and way: no prefix cache hits between them.
            for way in results:
                prompt = " ".join(rng.choice(words) for _ in range(args.input_words))
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": args.output_len,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "stream": True,
                }
                before = counters(args.url)
                started = time.perf_counter()
                if way == "one request, n":
                    first, _ = await completion(
                        client, args.url, {**body, "n": args.n, "seed": round_}
                    )
                else:
                    runs = await asyncio.gather(
                        *(
                            completion(client, args.url, {**body, "seed": round_ + i})
                            for i in range(args.n)
                        )
                    )
                    first = min(f for f, _ in runs)
                results[way].append((first, time.perf_counter() - started))
                after = counters(args.url)
                counted[way] = [
                    c + a - b for c, a, b in zip(counted[way], after, before, strict=True)
                ]
    print(
        f"n = {args.n}, {args.input_words} words in, {args.output_len} tokens out, {args.rounds} rounds"
    )
    base = statistics.median(end for _, end in results["n requests"])
    for way, runs in results.items():
        first = statistics.median(f for f, _ in runs) * 1e3
        end = statistics.median(e for _, e in runs)
        print(
            f"{way:>16}: first token p50 {first:7.0f} ms, all done p50 {end * 1e3:7.0f} ms "
            f"({base / end:.2f}x the n requests); per round {counted[way][0] / args.rounds:.0f} "
            f"prefills, {counted[way][1] / args.rounds / 1e6:.1f} MB of KV moved"
        )


if __name__ == "__main__":
    asyncio.run(main())
