"""Triton's model repository extension over a broker's repository ops (docs/models.md):
`GET`/`POST /v2/repository/index`, `POST /v2/repository/models/{m}/load` and `/unload`.

The broker (`serve --model-repository`) does the work and decides who may: `load` and
`unload` change the service, so with --curve-admins only an admin's key may send them
(the gateway's is the broker's own). A load waits for the new version's workers to load
and warm up, so its call waits up to LOAD_TIMEOUT_S, not the probe timeout.
"""

from __future__ import annotations

import json
from typing import Any

from batcher.gateway import oip
from batcher.gateway.core import Gateway

#: How long a load or an unload may take (new workers loading, old ones draining).
LOAD_TIMEOUT_S = 300.0


async def _call(gateway: Gateway, op: str, wait_s: float, **fields: Any) -> Any:
    if gateway.link.max_message_bytes is None:
        await gateway.link.learn_limits(gateway.settings.probe_timeout_ms / 1000.0)
    reply = await gateway.link.call({"op": op, **fields}, wait_s)
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise oip.OipError(str(err.get("code", "internal_error")), str(err.get("message", "")))
    return reply.get("output")


def ready_only(body: bytes) -> bool:
    """Whether an index request's body (`{"ready": true}`, or none) asks for ready models alone."""
    if not body.strip():
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        raise oip.bad_request("the repository index request's body is not JSON") from None
    return isinstance(doc, dict) and doc.get("ready") is True


async def index(gateway: Gateway, ready: bool = False) -> list[dict[str, Any]]:
    """Every model and version of the repository with its state and reason, as Triton's."""
    wait_s = gateway.settings.probe_timeout_ms / 1000.0
    models: list[dict[str, Any]] = (await _call(gateway, "repository_index", wait_s))["models"]
    return [m for m in models if m["state"] == "READY"] if ready else models


async def load(gateway: Gateway, model: str) -> dict[str, Any]:
    """Load (or reload) `model` from the repository: answered once its versions serve."""
    await _call(gateway, "load", LOAD_TIMEOUT_S, model=model)
    return {}


async def unload(gateway: Gateway, model: str) -> dict[str, Any]:
    """Unload `model`: answered once its versions have drained and stopped."""
    await _call(gateway, "unload", LOAD_TIMEOUT_S, model=model)
    return {}
