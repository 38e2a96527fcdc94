"""``RouterClient``: a Python client of the router's gRPC API, and ``pdcluster submit``.

    client = RouterClient("127.0.0.1:50051", api_key=None)
    client.generate("Hello", max_tokens=32)   # {"text", "token_ids", "finish_reason", ...}
    for chunk in client.stream("Hello"):      # {"text", "token_ids", "finish_reason"} per message
        ...
    client.generate([{"role": "user", "content": "Hi!"}])  # a chat: the assistant's reply

Sampling keywords: max_tokens, temperature, top_p, top_k, seed, stop (str or list),
stop_token_ids, ignore_eos, logprobs, min_tokens, model, request_id. A prompt is a string, a
list of token ids, or a chat (a list of {"role", "content"} messages). Errors raise :class:`RouterError` with the gRPC status.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from protos import router_pb2, router_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")
_PLAIN = ("ignore_eos", "min_tokens", "model", "request_id")
# text, token ids, or chat messages ({"role", "content"})
Prompt = str | Sequence[int] | Sequence[dict[str, str]]


class RouterError(Exception):
    """The router refused or failed a request. ``code`` is the gRPC status name
    (INVALID_ARGUMENT, UNAUTHENTICATED, RESOURCE_EXHAUSTED, UNAVAILABLE, ...);
    ``retry_after_s`` is set when the router is overloaded."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class RouterClient:
    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        api_key: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = grpc.insecure_channel(address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, prompt: Prompt, **sampling: Any) -> Iterator[dict[str, Any]]:
        """One dict per response message: request_id, text (new), token_ids (new),
        finish_reason (None until the last), logprobs when asked; the first has
        prompt_token_ids, the last usage. Leaving the loop early cancels the request."""
        call = self._stub.Generate(
            _request(prompt, sampling), metadata=self._metadata, timeout=self.timeout_s
        )
        try:
            for message in call:
                yield _to_dict(message)
        except grpc.RpcError as err:
            raise _error(err) from None
        finally:
            call.cancel()  # no-op when finished; cancels the request when the caller stopped

    def generate(self, prompt: Prompt, **sampling: Any) -> dict[str, Any]:
        """The whole result: request_id, text, token_ids, finish_reason, prompt_token_ids,
        usage (and logprobs when asked)."""
        result: dict[str, Any] = {"text": "", "token_ids": [], "finish_reason": None}
        logprobs: list[dict[str, Any]] = []
        for chunk in self.stream(prompt, **sampling):
            result["request_id"] = chunk["request_id"]
            result["text"] += chunk["text"]
            result["token_ids"] += chunk["token_ids"]
            logprobs += chunk.get("logprobs", [])
            for key in ("prompt_token_ids", "usage", "finish_reason"):
                if chunk.get(key) is not None:
                    result[key] = chunk[key]
        if sampling.get("logprobs") is not None:
            result["logprobs"] = logprobs
        return result

    def health(self) -> dict[str, Any]:
        try:
            reply = self._stub.Health(
                router_pb2.HealthRequest(), metadata=self._metadata, timeout=self.timeout_s
            )
        except grpc.RpcError as err:
            raise _error(err) from None
        details = json.loads(reply.details_json) if reply.details_json else {}
        return {**details, "status": reply.status, "prefill": reply.prefill, "decode": reply.decode}


def _request(prompt: Prompt, sampling: dict[str, Any]) -> router_pb2.GenerateRequest:
    unknown = set(sampling) - set(_OPTIONAL) - set(_PLAIN) - {"stop", "stop_token_ids"}
    if unknown:
        raise TypeError(f"unknown sampling options: {sorted(unknown)}")
    fields = {
        k: v for k, v in sampling.items() if k in _PLAIN or (k in _OPTIONAL and v is not None)
    }
    stop = sampling.get("stop") or []
    fields["stop"] = [stop] if isinstance(stop, str) else list(stop)
    fields["stop_token_ids"] = list(sampling.get("stop_token_ids") or [])
    if isinstance(prompt, str):
        fields["text"] = prompt
    elif prompt and all(isinstance(m, dict) for m in prompt):
        fields["chat"] = router_pb2.Chat(
            messages=[router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]
        )
    else:
        fields["token_ids"] = router_pb2.TokenIds(ids=list(prompt))
    return router_pb2.GenerateRequest(**fields)


def _to_dict(message: router_pb2.GenerateResponse) -> dict[str, Any]:
    out: dict[str, Any] = {
        "request_id": message.request_id,
        "text": message.text,
        "token_ids": list(message.token_ids),
        "finish_reason": message.finish_reason or None,
    }
    if message.logprobs:
        out["logprobs"] = [
            {
                "token_id": lp.token_id,
                "logprob": lp.logprob,
                "top": {t.token_id: t.logprob for t in lp.top},
            }
            for lp in message.logprobs
        ]
    if message.prompt_token_ids:
        out["prompt_token_ids"] = list(message.prompt_token_ids)
    if message.HasField("usage"):
        usage = message.usage
        out["usage"] = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }
    return out


def _error(err: grpc.RpcError) -> RouterError:
    code = err.code().name if err.code() else "UNKNOWN"
    retry = None
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after":
            retry = float(value)
    return RouterError(code, err.details() or "", retry)


# ---- pdcluster submit ----------------------------------------------------------------------


def add_submit_parser(subparsers) -> None:
    """``pdcluster submit "prompt" [--stream] [--address HOST:PORT] [--max-tokens N]
    [--temperature T] [--json]``: one request to a running router over gRPC."""
    p = subparsers.add_parser("submit", help="send one prompt to a running router (gRPC)")
    p.add_argument("prompt", help="prompt text (with --chat: the user's message)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a chat message (the model's chat template) and print the reply",
    )
    p.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        help=f"router gRPC address (default {DEFAULT_ADDRESS})",
    )
    p.add_argument("--api-key", default=None, help="the router's API key, if it has one")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    p.add_argument("--json", action="store_true", help="print the result (or each chunk) as JSON")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S seconds for the router to be ready (e.g. right after serve)",
    )
    p.set_defaults(func=run_submit)


def wait_until_ready(client: RouterClient, timeout_s: float) -> None:
    """Poll the router's health until it is ok; RouterError(UNAVAILABLE) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.health().get("status") == "ok":
                return
        except RouterError:
            if time.monotonic() >= deadline:
                raise
        if time.monotonic() >= deadline:
            raise RouterError("UNAVAILABLE", f"the router was not ready within {timeout_s:.0f}s")
        time.sleep(0.5)


def run_submit(args) -> int:
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    sampling = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
    }
    try:
        with RouterClient(args.address, api_key=args.api_key, timeout_s=args.timeout) as client:
            if args.wait > 0:
                wait_until_ready(client, args.wait)
            if args.stream:
                for chunk in client.stream(prompt, **sampling):
                    if args.json:
                        print(json.dumps(chunk), flush=True)
                    else:
                        print(chunk["text"], end="", flush=True)
                if not args.json:
                    print()
            else:
                result = client.generate(prompt, **sampling)
                print(json.dumps(result) if args.json else result["text"])
    except RouterError as err:
        hint = " (is the router running? see pdcluster serve)" if err.code == "UNAVAILABLE" else ""
        print(f"error: {err}{hint}", file=sys.stderr)
        return 1
    return 0
