"""Triton's model repository extension over a broker's repository ops (docs/models.md):
`GET`/`POST /v2/repository/index`, `POST /v2/repository/models/{m}/load` and `/unload`.

The broker (`serve --model-repository`) does the work and decides who may: `load` and
`unload` change the service, so with --curve-admins only an admin's key may send them
(the gateway's is the broker's own). A load waits for the new version's workers to load
and warm up, so its call waits up to LOAD_TIMEOUT_S, not the probe timeout.

A gateway of many brokers asks every connected one: the index is theirs merged, and a
load or unload goes to each broker whose repository holds the model (each answers
`unknown_model` when its repository does not, and is then left out), answered once all
have; docs/gateway.md, "Many brokers".
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from batcher.gateway import oip
from batcher.gateway.core import BrokerLink, Gateway
from batcher.wire.protocol import ErrorCode

#: How long a load or an unload may take (new workers loading, old ones draining).
LOAD_TIMEOUT_S = 300.0


#: A merged index entry's state when brokers disagree: the most served one wins.
STATE_RANK = {"READY": 0, "LOADING": 1, "UNLOADING": 2, "UNAVAILABLE": 3}


async def _call(gateway: Gateway, link: BrokerLink, op: str, wait_s: float, **fields: Any) -> Any:
    if link.max_message_bytes is None:
        await link.learn_limits(gateway.settings.probe_timeout_ms / 1000.0)
    reply = await link.call({"op": op, **fields}, wait_s)
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise oip.OipError(str(err.get("code", "internal_error")), str(err.get("message", "")))
    return reply.get("output")


async def _every_broker(gateway: Gateway, op: str, wait_s: float, **fields: Any) -> list[Any]:
    """`op` sent to every connected broker at once (else to the one known): each one's
    output or OipError (BaseException for a bug of ours), in order."""
    links = [b.link for b in gateway.pool.brokers.values() if b.link.up] or [gateway.pool.any_link()]
    return await asyncio.gather(
        *(_call(gateway, link, op, wait_s, **fields) for link in links), return_exceptions=True
    )


def _outputs(answers: list[Any], skip: frozenset[str] = frozenset({ErrorCode.BAD_REQUEST})) -> list[Any]:
    """The outputs of the brokers that answered, once every one has: a broker without a
    repository (bad_request) or, for load and unload, without the model (unknown_model)
    is left out; any other error is raised, and so is the first error when none answered."""
    errors = [a for a in answers if isinstance(a, BaseException)]
    for error in errors:
        if not isinstance(error, oip.OipError) or error.code not in skip:
            raise error
    outputs = [a for a in answers if not isinstance(a, BaseException)]
    if not outputs:  # none is for it: "no such model" says more than "no repository here"
        unknown = [e for e in errors if isinstance(e, oip.OipError) and e.code == ErrorCode.UNKNOWN_MODEL]
        raise (unknown or errors)[0]
    return outputs


def ready_only(body: bytes) -> bool:
    """Whether an index request's body (`{"ready": true}`, or none) asks for ready models alone."""
    if not body.strip():
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        raise oip.bad_request("the repository index request's body is not JSON") from None
    return isinstance(doc, dict) and doc.get("ready") is True


def merge_indexes(indexes: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One index of many brokers' (docs/gateway.md, "Many brokers"): one entry per model
    and version, its state the most served any broker has (READY over LOADING over
    UNLOADING over UNAVAILABLE) with that broker's reason, sorted by name and version."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for models in indexes:
        for m in models:
            key = (str(m["name"]), str(m["version"]))
            known = merged.get(key)
            if known is None or STATE_RANK.get(m["state"], 9) < STATE_RANK.get(known["state"], 9):
                merged[key] = m
    return [merged[k] for k in sorted(merged, key=lambda k: (k[0], k[1].zfill(20)))]


async def index(gateway: Gateway, ready: bool = False) -> list[dict[str, Any]]:
    """Every model and version of every broker's repository with its state and reason,
    as Triton's (merge_indexes)."""
    wait_s = gateway.settings.probe_timeout_ms / 1000.0
    answers = await _every_broker(gateway, "repository_index", wait_s)
    models = merge_indexes([out["models"] for out in _outputs(answers)])
    return [m for m in models if m["state"] == "READY"] if ready else models


async def load(gateway: Gateway, model: str) -> dict[str, Any]:
    """Load (or reload) `model` on every broker whose repository holds it: answered once
    its versions serve on each; unknown_model when none holds it."""
    answers = await _every_broker(gateway, "load", LOAD_TIMEOUT_S, model=model)
    _outputs(answers, _NOT_HERE)
    return {}


async def unload(gateway: Gateway, model: str) -> dict[str, Any]:
    """Unload `model` on every broker that serves or holds it: answered once its
    versions have drained and stopped on each; unknown_model when none has it."""
    answers = await _every_broker(gateway, "unload", LOAD_TIMEOUT_S, model=model)
    _outputs(answers, _NOT_HERE)
    return {}


#: The answers of brokers a load or unload is not for: no repository, or not this model.
_NOT_HERE = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_MODEL})
