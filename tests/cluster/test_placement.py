"""What a replica reserves (cluster.replica_shape), how a pending one's reason reads, and what
is asked of Ray's autoscaler (cluster.placement), without a cluster."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster import placement
from cluster.config import ClusterConfig
from cluster.replica_shape import ReplicaShape, label_matches


def test_a_pool_reserves_its_cpus_gpus_and_resources_as_one_bundle():
    config = ClusterConfig.from_dict(
        {
            "pools": {
                "decode": {
                    "num_cpus": 8,
                    "num_gpus": 8,
                    "resources": {"accelerator_type:H100": 0.001},
                    "node_labels": {"pool": "decode"},
                    "engine": {"tensor_parallel_size": 8},
                },
                "prefill": {"num_cpus": 1},
            }
        }
    )
    shape = config.decode.shape()
    assert shape.bundle == {"CPU": 8.0, "GPU": 8.0, "accelerator_type:H100": 0.001}
    assert shape.describe() == "8 GPU, 8 CPU, accelerator_type:H100 on a node labelled pool=decode"
    assert config.prefill.shape().bundle == {"CPU": 1.0}  # no GPU: not asked for


@pytest.mark.parametrize(
    "value, selector, matches",
    [
        ("a", "a", True),
        ("b", "a", False),
        ("b", "!a", True),
        (None, "!a", True),
        ("b", "in(a, b)", True),
        ("c", "in(a,b)", False),
        ("c", "!in(a,b)", True),
    ],
)
def test_label_selectors(value, selector, matches):
    assert label_matches(value, selector) is matches


def test_a_node_fits_a_bundle_by_resources_and_labels():
    shape = ReplicaShape({"CPU": 2.0, "GPU": 1.0}, {"zone": "a"})
    assert shape.fits({"CPU": 4, "GPU": 1}, {"zone": "a"})
    assert not shape.fits({"CPU": 4, "GPU": 1}, {"zone": "b"})
    assert not shape.fits({"CPU": 4}, {"zone": "a"})


def _nodes(monkeypatch, total: dict, free: dict | None) -> None:
    node = {"NodeID": "n1", "Alive": True, "Resources": total, "Labels": {}}
    monkeypatch.setattr(placement.ray, "nodes", lambda: [node])
    monkeypatch.setattr(placement, "_free_resources_per_node", lambda: free)


def test_a_pending_reason_says_whether_any_node_could_ever_hold_it(monkeypatch):
    shape = ReplicaShape({"CPU": 1.0, "GPU": 8.0}, {})
    _nodes(monkeypatch, {"CPU": 16, "GPU": 4}, {"n1": {"CPU": 16, "GPU": 4}})
    assert "no node of the cluster has that much" in placement.pending_reason(shape)
    _nodes(monkeypatch, {"CPU": 16, "GPU": 8}, {"n1": {"CPU": 16, "GPU": 2}})
    reason = placement.pending_reason(shape)
    assert reason == "waiting for 8 GPU, 1 CPU free on one node (other actors hold it)"


def test_the_autoscaler_is_asked_for_every_wanted_replica_only_when_that_changes(monkeypatch):
    import ray.autoscaler.sdk

    sent: list[list[dict]] = []
    monkeypatch.setattr(
        ray.autoscaler.sdk, "request_resources", lambda bundles: sent.append(bundles)
    )
    requests = placement.AutoscalerRequests()
    big, small = ReplicaShape({"GPU": 8.0}, {}), ReplicaShape({"CPU": 1.0}, {})
    assert requests.update([big, small, small])
    assert not requests.update([small, big, small])  # the same set: not sent again
    assert requests.update([small])  # scale-down: the request shrinks, idle nodes may go
    assert requests.update([])
    assert sent == [[{"CPU": 1.0}, {"CPU": 1.0}, {"GPU": 8.0}], [{"CPU": 1.0}], []]


def test_the_cli_and_config_do_not_import_ray():
    """Ray reads its environment (token auth, loopback) when first imported: the CLI sets it
    first, so nothing the CLI imports at start may import Ray."""
    code = "import sys, cluster.cli as c; c.build_parser(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
