"""Where a replica runs: its resources as a Ray placement group, why it is still pending,
the node it landed on, and what the cluster asks of Ray's autoscaler.

A replica's resources (``num_cpus``, ``num_gpus``, custom ``resources``) are one bundle of a
STRICT_PACK placement group, reserved before its actor starts: a tensor-parallel replica's
ranks are processes of that one actor, and Ray gives an actor the resources of one bundle,
so its GPUs are reserved together, on one node. ``node_labels`` selects the nodes it may
use (Ray node labels, ``ray start --labels``). Called from the controller's event loop;
the Ray calls here are short GCS reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from cluster.replica_shape import ReplicaShape

logger = logging.getLogger(__name__)


def reserve(shape: ReplicaShape, name: str) -> PlacementGroup:
    """Ask Ray for the replica's placement group (returns at once; ``ready()`` says when)."""
    return placement_group(
        [dict(shape.bundle)],
        strategy="STRICT_PACK",
        name=name,
        bundle_label_selector=[dict(shape.labels)] if shape.labels else None,
    )


def release(group: PlacementGroup | None) -> None:
    if group is None:
        return
    try:
        remove_placement_group(group)
    except Exception as err:  # noqa: BLE001 - already gone with its node, or Ray shutting down
        logger.debug("removing a placement group: %s", err)


def pending_reason(shape: ReplicaShape) -> str:
    """Why a bundle is not placed yet, from the cluster's nodes as Ray sees them now."""
    wanted = shape.describe()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not any(shape.fits(n.get("Resources", {}), n.get("Labels", {})) for n in nodes):
        return (
            f"waiting for {wanted}: no node of the cluster has that much (asked Ray's "
            "autoscaler for a node that does)"
        )
    free = _free_resources_per_node()
    if free is not None and any(
        shape.fits(free.get(n["NodeID"], {}), n.get("Labels", {})) for n in nodes
    ):
        return f"waiting for {wanted}: free now, Ray is placing it"
    return f"waiting for {wanted} free on one node (other actors hold it)"


def _free_resources_per_node() -> dict[str, dict[str, float]] | None:
    try:
        from ray._private.state import state

        return state.available_resources_per_node()
    except Exception:  # noqa: BLE001 - a private API: the reason is only less precise
        return None


def node_address(group: PlacementGroup) -> str:
    """The IP of the node a placed group's bundle is on ("" when unknown)."""
    try:
        from ray.util import placement_group_table

        node_id = placement_group_table(group)["bundles_to_node_id"][0]
    except Exception:  # noqa: BLE001 - removed meanwhile
        return ""
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node.get("NodeManagerAddress", "")
    return ""


class AutoscalerRequests:
    """What the cluster asks of Ray's autoscaler: a bundle for every replica it wants (pending,
    starting, serving or draining), so that pending ones get a node and nodes that hold the
    rest are kept; a smaller set on scale-down lets idle nodes go. Sent only when it changes
    (``ray.autoscaler.sdk.request_resources`` replaces the previous request)."""

    def __init__(self) -> None:
        self._last: list[dict] | None = None

    def update(self, shapes: Iterable[ReplicaShape]) -> bool:
        bundles = sorted((dict(s.bundle) for s in shapes), key=lambda b: sorted(b.items()))
        if bundles == self._last:
            return False
        from ray.autoscaler.sdk import request_resources

        try:
            request_resources(bundles=bundles)
        except Exception as err:  # noqa: BLE001 - no autoscaler API here: placement still works
            logger.warning("asking Ray's autoscaler for %d bundles failed: %s", len(bundles), err)
            return False
        self._last = bundles
        return True
