"""pdcluster on a real two-node Ray cluster (tests/integration/netns_cluster.py: two network
namespaces, a veth pair, a Ray node in each), run as a user runs it: `ray start` on each
node, `pdcluster serve --address HEAD` on the head. Prefill on the head, decode on the
worker: greedy tokens through the router equal the offline engine's (gRPC, and NIXL); a
router address that is not the head's ends `serve` at once with the error; the worker node
killed mid-stream: the stream finishes exactly on a replacement on the head."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from engine import LLM, SamplingParams
from tests.integration.netns_cluster import TwoNodeCluster, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

# Token-exact against the offline engine: one GEMM library on both sides.
ENGINE = {
    "num_kv_blocks": 256,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "cpu_gemm": "torch",
}
PROMPTS = ["a request that crosses nodes", "and another one, a little longer than that"]
BLOCKER = "pdcluster-test-blocker"


def greedy(prompt: str, max_tokens: int) -> list[int]:
    llm = LLM("tiny", progress=False, **ENGINE)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate([prompt], params)[0].token_ids


@pytest.fixture(scope="module")
def nodes():
    # The head holds the prefill replica (only it has `prefill_node`) and room for a decode
    # replica, which the test holds at start-up (block_head_decode_slot); the worker has
    # room for a decode replica.
    cluster = TwoNodeCluster(
        head_args=["--num-cpus=2", '--resources={"prefill_node": 1, "decode_slot": 1}'],
        worker_args=["--num-cpus=1", '--resources={"decode_slot": 1}'],
    ).up()
    try:
        yield cluster
    finally:
        cluster.down()


def config_file(nodes: TwoNodeCluster, **kv) -> str:
    import yaml

    path = f"{nodes.temp_dir}/cluster.yaml"
    config = {
        "model": "tiny",
        "engine": ENGINE,
        "pools": {
            "prefill": {"replicas": 1, "num_cpus": 1, "resources": {"prefill_node": 1}},
            "decode": {
                "replicas": 1,
                "num_cpus": 1,
                "resources": {"decode_slot": 1},
                "placement_timeout_s": 60,
            },
        },
        "kv": kv,
        "router": {"host": nodes.addresses[0], "port": 8000, "grpc_port": 50051},
    }
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def block_head_decode_slot(nodes: TwoNodeCluster, block: bool) -> None:
    """Hold (or free) the head's decode slot with a detached placement group, so that at
    start-up the decode replica can only go to the worker."""
    connect = (
        f"import ray; ray.init(address={nodes.head_address!r}, namespace='test', "
        "log_to_driver=False, logging_level='ERROR')\n"
        "from ray.util import placement_group, get_placement_group, remove_placement_group\n"
    )
    if block:
        code = (
            f"{connect}here = ray.get_runtime_context().get_node_id()\n"
            f"pg = placement_group([{{'decode_slot': 1}}], name={BLOCKER!r}, lifetime='detached', "
            "bundle_label_selector=[{'ray.io/node-id': here}])\n"
            "ray.get(pg.ready(), timeout=60)\n"
        )
    else:
        code = f"{connect}remove_placement_group(get_placement_group({BLOCKER!r}))\n"
    nodes.python(0, code)


class Serve:
    """`pdcluster serve` running in the head's namespace; its output collected."""

    def __init__(self, nodes: TwoNodeCluster, args: list[str]) -> None:
        self.nodes = nodes
        self.started = time.monotonic()
        self.process = nodes.spawn(
            0, ["pdcluster", "serve", "--address", nodes.head_address, *args]
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip())

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_serving(self, timeout_s: float = 180) -> None:
        def serving() -> bool:
            if self.process.poll() is not None:
                time.sleep(0.5)  # the reader's last lines
                raise AssertionError(f"pdcluster serve exited:\n{self.output}")
            return any(line.startswith("pdcluster serving") for line in self.lines)

        try:
            self.nodes.wait_for(serving, timeout_s, "pdcluster serve to start")
        except AssertionError as err:
            raise AssertionError(f"{err}; it printed:\n{self.output}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(2)  # Ctrl-C
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._reader.join(timeout=5)


@contextmanager
def serving(nodes: TwoNodeCluster, *args: str):
    block_head_decode_slot(nodes, True)
    serve = Serve(nodes, ["--config", config_file(nodes), *args])
    try:
        serve.wait_serving()
        block_head_decode_slot(nodes, False)  # room on the head again
        yield serve
    finally:
        serve.stop()
        try:
            block_head_decode_slot(nodes, False)
        except RuntimeError:
            pass  # freed already


def status(nodes: TwoNodeCluster) -> dict:
    out = nodes.run(0, ["pdcluster", "status", "--json", "--address", nodes.head_address])
    return json.loads(out)


def node_of(nodes: TwoNodeCluster, name: str) -> str:
    pools = status(nodes)["pools"]
    return next(r["node"] for rs in pools.values() for r in rs if r["name"] == name)


CLIENT = """
import json, sys, httpx
url, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True}
with httpx.Client(timeout=300) as client:
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    assert choice.get("finish_reason") in (None, "length"), choice
                    print(json.dumps(choice.get("token_ids") or []), flush=True)
"""


def stream(nodes: TwoNodeCluster, prompt: str, max_tokens: int, on_token_count=None) -> list[int]:
    """A greedy streamed completion from a client in the head's namespace; ``on_token_count``
    is called with the number of tokens received after each event."""
    url = f"http://{nodes.addresses[0]}:8000"
    client = nodes.spawn(0, [sys.executable, "-c", CLIENT, url, prompt, str(max_tokens)])
    tokens: list[int] = []
    for line in client.stdout:
        try:
            tokens.extend(json.loads(line))
        except ValueError:
            continue  # a traceback's line: the exit code below says it failed
        if on_token_count is not None:
            on_token_count(len(tokens))
    assert client.wait(timeout=300) == 0, f"the client failed after {len(tokens)} tokens"
    return tokens


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_greedy_tokens_across_nodes_equal_the_offline_engine(nodes, transport):
    if transport == "nixl":
        from kv_transfer.nixl_agent import nixl_unavailable

        if (why := nixl_unavailable()) is not None:
            pytest.skip(f"NIXL: {why}")
    with serving(nodes, "--kv-transport", transport):
        assert node_of(nodes, "prefill-0") == nodes.addresses[0]
        assert node_of(nodes, "decode-0") == nodes.addresses[1]
        for prompt in PROMPTS:
            assert stream(nodes, prompt, 24) == greedy(prompt, 24)


def test_a_router_address_that_is_not_the_head_s_ends_serve_with_the_error(nodes):
    serve = Serve(nodes, ["--model", "tiny", "--host", nodes.addresses[1]])
    try:
        code = serve.process.wait(timeout=60)
        waited = time.monotonic() - serve.started
    finally:
        serve.stop()
    assert code != 0
    assert f"cannot bind the HTTP API to {nodes.addresses[1]}:8000" in serve.output, serve.output
    assert waited < 10, f"{waited:.1f} s:\n{serve.output}"


def test_a_decode_node_lost_mid_stream_finishes_exactly_on_a_replacement(nodes):
    prompt, max_tokens = "a stream whose node is lost", 400
    expected = greedy(prompt, max_tokens)
    with serving(nodes):
        assert node_of(nodes, "decode-0") == nodes.addresses[1]
        killed = threading.Event()

        def kill_the_worker_node(count: int) -> None:
            if count >= 20 and not killed.is_set():
                killed.set()
                nodes.kill_node(1)  # every process of the decode replica's node

        try:
            tokens = stream(nodes, prompt, max_tokens, kill_the_worker_node)
        finally:
            if killed.is_set():
                nodes.start_node(1)  # for the tests after this one
        assert killed.is_set(), "the stream ended before the node could be killed"
        assert tokens == expected
        assert node_of(nodes, "decode-0") == nodes.addresses[0]  # replaced on the head
        events = [e["message"] for e in status(nodes)["events"]]
        assert any(f"decode-0 on {nodes.addresses[1]} died" in m for m in events), events
