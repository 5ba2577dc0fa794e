"""Triton's model configuration and statistics extensions, from the broker's `stats`.

Triton's tools ask for these before anything else (perf_analyzer stops at once without
the configuration), so the gateway answers them in Triton's own form: the JSON its HTTP
endpoints give (`GET /v2/models/{m}/config`, `/v2/models[/{m}]/stats`), which the gRPC
calls (`ModelConfig`, `ModelStatistics`) parse into Triton's messages. What each field
holds in batcher's terms: docs/gateway.md, "Triton's extensions".
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from batcher.gateway import oip
from batcher.gateway.core import Gateway, check_version
from batcher.wire.protocol import ErrorCode

#: Triton's DataType names of the v2 datatypes (BYTES is Triton's TYPE_STRING).
DATA_TYPES = {
    "BOOL": "TYPE_BOOL",
    "UINT8": "TYPE_UINT8",
    "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64",
    "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "FP16": "TYPE_FP16",
    "FP32": "TYPE_FP32",
    "FP64": "TYPE_FP64",
    "BYTES": "TYPE_STRING",
    "BF16": "TYPE_BF16",
}
PLATFORM = "batcher"


async def _models(gateway: Gateway) -> dict[str, Any]:
    stats = await gateway._control("stats")
    models: dict[str, Any] = stats.get("models") or {}
    return models


def _entry(models: dict[str, Any], model: str, version: str) -> dict[str, Any]:
    check_version(model, version)
    entry = models.get(model) if version in ("", oip.MODEL_VERSION) else None
    if f"{model}/{version or ''}" in models or entry is None:  # a repository's version, NAME/V
        entry = models.get(f"{model}/{version or _newest(models, model)}")
    if entry is None:
        served = ", ".join(sorted(models)) or "none"
        raise oip.OipError(ErrorCode.UNKNOWN_MODEL, f"no model {model!r} (models: {served})")
    return dict(entry)


def _newest(models: dict[str, Any], model: str) -> str:
    """The newest served version of a repository's model (its stats entries are NAME/V)."""
    keys = [k.rpartition("/") for k in models]
    versions = [int(v) for name, _, v in keys if name == model and v.isdigit()]
    versions = [v for v in versions if models[f"{model}/{v}"].get("workers")] or versions
    return str(max(versions)) if versions else ""


async def model_config(gateway: Gateway, model: str, version: str = "") -> dict[str, Any]:
    """The model's configuration as Triton's `GET /v2/models/{m}/config` gives it;
    unknown_model (404) for a model or version not served."""
    return config_of(model, _entry(await _models(gateway), model, version))


def config_of(model: str, entry: dict[str, Any]) -> dict[str, Any]:
    """A `stats` model entry as Triton's ModelConfig: a batch axis of up to
    max_batch_size on every tensor (dims are without it), the dynamic batcher's preferred
    sizes (batch_sizes) and queue delay (max_wait_ms), an instance group per GPU (and one
    for the workers on CPU) with the live workers' counts."""
    signature = entry.get("signature") or {}
    config: dict[str, Any] = {
        "name": model,
        "platform": PLATFORM,
        "backend": PLATFORM,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": int(entry.get("max_batch_size") or 0),
        "input": [_tensor(t, "data_type") for t in signature.get("inputs") or []],
        "output": [_tensor(t, "data_type") for t in signature.get("outputs") or []],
        "dynamic_batching": {
            "preferred_batch_size": list(entry.get("batch_sizes") or []),
            "max_queue_delay_microseconds": round(float(entry.get("max_wait_ms") or 0.0) * 1000.0),
        },
        "instance_group": _instance_groups(model, entry.get("worker_list") or []),
    }
    return config


def _tensor(spec: dict[str, Any], key: str) -> dict[str, Any]:
    shape = list(spec.get("shape") or [])
    return {
        "name": str(spec.get("name")),
        key: DATA_TYPES.get(str(spec.get("datatype")), "TYPE_INVALID"),
        "dims": [int(d) for d in shape[1:]],  # the signature's first axis is the batch's
    }


def _instance_groups(model: str, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    per_gpu = Counter(w.get("gpu") for w in workers)
    groups = []
    for i, (gpu, count) in enumerate(sorted(per_gpu.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))):
        group: dict[str, Any] = {"name": f"{model}_{i}", "count": count}
        if gpu is None:
            group["kind"] = "KIND_CPU"
        else:
            group.update(kind="KIND_GPU", gpus=[int(gpu)])
        groups.append(group)
    return groups


async def model_statistics(gateway: Gateway, model: str = "", version: str = "") -> dict[str, Any]:
    """Triton's `GET /v2/models[/{m}]/stats`: every model's statistics, or one model's;
    unknown_model (404) for a model or version not served."""
    models = await _models(gateway)
    now_ms = time.time() * 1000.0
    if model:
        entries = {model: _entry(models, model, version)}
    else:
        check_version("", version)
        entries = models
    return {"model_stats": [statistics_of(name, e, now_ms) for name, e in sorted(entries.items())]}


def statistics_of(model: str, entry: dict[str, Any], now_ms: float) -> dict[str, Any]:
    """A `stats` model entry's totals (batcher/broker/stats.py, Totals) as Triton's
    ModelStatistics; last_inference is when its last batch was answered (ms since the
    epoch, 0 before any)."""
    totals = entry.get("totals") or {}
    ago = totals.get("last_batch_s_ago")
    success = _duration(totals.get("success"))
    batches = totals.get("by_batch_size") or []
    name, _, version = model.rpartition("/")  # a repository's version is its own model, NAME/V
    if not (name and version.isdigit()):
        name, version = model, oip.MODEL_VERSION
    return {
        "name": name,
        "version": version,
        "last_inference": 0 if ago is None else max(0, round(now_ms - float(ago) * 1000.0)),
        "inference_count": success["count"],
        "execution_count": sum(int(b[1]) for b in batches),
        "inference_stats": {
            "success": success,
            "fail": _duration(totals.get("fail")),
            "queue": _duration(totals.get("queue")),
            "compute_input": _duration(totals.get("compute_input")),
            "compute_infer": _duration(totals.get("compute_infer")),
            "compute_output": _duration(totals.get("compute_output")),
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {
                "batch_size": int(size),
                "compute_input": {"count": int(count), "ns": int(input_ns)},
                "compute_infer": {"count": int(count), "ns": int(infer_ns)},
                "compute_output": {"count": int(count), "ns": int(output_ns)},
            }
            for size, count, input_ns, infer_ns, output_ns in batches
        ],
        "memory_usage": [],
    }


def _duration(pair: Any) -> dict[str, int]:
    count, ns = pair if isinstance(pair, list) and len(pair) == 2 else (0, 0)
    return {"count": int(count), "ns": int(ns)}
