"""Environment Ray reads at import time, set before ``import ray`` by the CLI."""

from __future__ import annotations

import os
from pathlib import Path


def prepare_ray_environment(address: str | None) -> None:
    """A local cluster stays on loopback; joining a cluster that uses Ray's token
    authentication (``ray start`` writes ~/.ray/auth_token) sends the token. Settings the
    user made themselves are kept."""
    if address is None:
        # Ray otherwise advertises the machine's network address even for a local cluster.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    elif "RAY_AUTH_MODE" not in os.environ:
        token_file = Path(
            os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token")
        )
        if os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file():
            os.environ["RAY_AUTH_MODE"] = "token"
