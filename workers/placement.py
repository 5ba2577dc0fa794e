"""Which GPU each of `serve`'s workers runs on: a pure function of the settings.

The devices are those named by `--gpus`, else the ones visible to `serve` (the ids in
CUDA_VISIBLE_DEVICES, else the GPUs the NVIDIA driver lists), else none: then every
worker runs without a GPU. A model may be pinned to some of the devices (`gpus = [0]`
in its config table). Each device takes at most `workers_per_gpu` workers of each model,
and a model's workers go to its least loaded devices first, so models share devices
evenly and no worker is ever given a GPU id that does not exist.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batcher.errors import SettingsError

#: The highest CPU id a CPU list may name (Linux's largest NR_CPUS is 8192).
MAX_CPU_ID = 8191
#: Where the NVIDIA driver lists one folder per GPU.
NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"
#: Workers of a model when nothing says how many and it has no device.
DEFAULT_WORKERS_WITHOUT_GPU = 2


def visible_gpus(
    environ: Mapping[str, str] | None = None, driver_dir: str = NVIDIA_GPUS_DIR
) -> tuple[int, ...]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES when it lists ids, else one
    id per GPU the driver lists, else none."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [part.strip() for part in listed.split(",") if part.strip()]
        if all(part.isdigit() for part in ids):
            return tuple(dict.fromkeys(int(part) for part in ids))
        return tuple(range(len(ids)))  # UUIDs or MIG names: the CUDA runtime numbers them 0..n-1
    try:
        return tuple(range(len(os.listdir(driver_dir))))
    except OSError:
        return ()


def place_workers(
    models: Sequence[str],
    devices: Sequence[int],
    workers_per_model: int | None = None,
    workers_per_gpu: int = 1,
    model_gpus: Mapping[str, Sequence[int]] | None = None,
    model_workers: Mapping[str, int] | None = None,
) -> list[tuple[str, int | None]]:
    """(model, GPU id or None) for every worker to start, in start order.

    A model's worker count is its own (`model_workers`), else `workers_per_model`, else
    one per allowed device times `workers_per_gpu` (2 without devices). Raises ValueError,
    naming the model, for a pinned GPU that is not among the devices or for more workers
    than its devices take.
    """
    pinned = dict(model_gpus or {})
    counts = dict(model_workers or {})
    unknown = sorted(set(pinned) - set(models)) + sorted(set(counts) - set(models))
    if unknown:
        raise SettingsError(f"GPU placement names models that are not served: {', '.join(unknown)}")
    plan: list[tuple[str, int | None]] = []
    load: Counter[int] = Counter()  # workers on each device, all models together
    for model in models:
        allowed = _allowed(model, devices, pinned.get(model))
        count = counts.get(model, workers_per_model)
        if not allowed:
            plan += [(model, None)] * (DEFAULT_WORKERS_WITHOUT_GPU if count is None else count)
            continue
        room = len(allowed) * workers_per_gpu
        count = room if count is None else count
        if count > room:
            raise SettingsError(
                f"model {model!r} needs {count} workers but its GPUs {list(allowed)} take {room} "
                f"(--workers-per-gpu {workers_per_gpu})"
            )
        mine: Counter[int] = Counter()
        for _ in range(count):
            gpu = min((g for g in allowed if mine[g] < workers_per_gpu), key=lambda g: (load[g], mine[g], g))
            mine[gpu] += 1
            load[gpu] += 1
            plan.append((model, gpu))
    return plan


def _allowed(model: str, devices: Sequence[int], pins: Sequence[int] | None) -> tuple[int, ...]:
    if pins is None:
        return tuple(devices)
    missing = [g for g in pins if g not in devices]
    if missing:
        have = ", ".join(map(str, devices)) or "none"
        raise SettingsError(
            f"model {model!r} is pinned to GPU {missing[0]}, which is not a device here ({have})"
        )
    return tuple(dict.fromkeys(pins))


def threads_per_worker(workers_on_host: int) -> int:
    """Intra-op threads per worker so that workers x threads <= the cores this process
    may use (its affinity, which a container's cpuset narrows; else every core)."""
    cores = len(usable_cpus()) or os.cpu_count() or 1
    return max(1, cores // max(1, workers_on_host))


def parse_cpus(text: str) -> tuple[int, ...]:
    """CPU ids from the list syntax of `taskset -c` and cpusets: "0,2-3" -> (0, 2, 3)."""
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not _is_id(first) or (dash and not _is_id(last)):
            raise SettingsError(f"CPU list {text!r}: {part.strip()!r} is not an id or a range like 2-3")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise SettingsError(f"CPU list {text!r}: the range {part.strip()!r} runs backwards")
        if high > MAX_CPU_ID:
            raise SettingsError(f"CPU list {text!r}: CPU ids go up to {MAX_CPU_ID}, got {high}")
        cpus.extend(range(low, high + 1))
    return tuple(sorted(set(cpus)))


def _is_id(text: str) -> bool:
    return text.isascii() and text.isdigit()  # not "²" or a full-width digit, which isdigit() takes


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity, which a cpuset or taskset may
    narrow); () where the platform cannot say or pin (not Linux)."""
    getter = getattr(os, "sched_getaffinity", None)
    return tuple(sorted(getter(0))) if getter is not None else ()


def pin_to(cpus: Sequence[int]) -> None:
    """Run the calling thread, and the threads it starts from now on, on `cpus` only.
    Call it before a zmq context or a model starts its threads: they keep the mask they
    were started with. A process may widen its mask to any CPU of its cpuset, so a
    worker can be given cores its parent was kept off."""
    setter = getattr(os, "sched_setaffinity", None)
    if setter is None:
        raise SettingsError("pinning to CPUs needs Linux (os.sched_setaffinity)")
    wanted = set(cpus)
    try:
        setter(0, wanted)
    except OSError as exc:  # EINVAL: none of them is usable here
        raise SettingsError(f"cannot run on CPUs {_cpu_list(cpus)}: {exc.strerror}") from None
    missing = sorted(wanted - set(usable_cpus()))  # the kernel drops CPUs outside the cpuset
    if missing:
        raise SettingsError(f"CPU {missing[0]} is not one this machine lets this process use")


def _cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus))


@dataclass(frozen=True)
class CpuPlan:
    """serve --pin-cpus: the cores the broker (and serve's gateway) keep, and each
    worker's own, in placement order."""

    broker: tuple[int, ...]
    workers: tuple[tuple[int, ...], ...]


def plan_cpus(usable: Sequence[int], workers: int, threads: int) -> CpuPlan:
    """Give each worker `threads` cores of its own, from the highest-numbered down, and
    leave the rest (at least one) to the broker, so that no worker's model competes with
    the broker, the other workers or each other for a core."""
    cores = sorted(usable)
    if not cores:
        raise SettingsError("--pin-cpus needs Linux (os.sched_setaffinity)")
    need = workers * threads
    if need >= len(cores):
        raise SettingsError(
            f"--pin-cpus needs a core left for the broker: {workers} worker(s) x {threads} "
            f"thread(s) on {len(cores)} core(s); lower --workers or --threads-per-worker"
        )
    top = len(cores)
    own = tuple(tuple(cores[top - (i + 1) * threads : top - i * threads]) for i in range(workers))
    return CpuPlan(tuple(cores[: top - need]), own)


def pinned_threads_per_worker(usable: Sequence[int], workers: int) -> int:
    """--pin-cpus without --threads-per-worker: the cores but one (the broker's) divided
    among the workers, at least 1."""
    return max(1, (len(usable) - 1) // max(1, workers))
