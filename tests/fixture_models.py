"""Models for the integration tests, loaded by workers as `tests.fixture_models:NAME`."""

from __future__ import annotations

import os
import threading
import time
from typing import Any


def flaky(inputs: list[Any]) -> list[Any]:
    """Echo, but raise for the whole batch when any input is "boom"."""
    if "boom" in inputs:
        raise ValueError(f"boom in a batch of {len(inputs)}")
    return list(inputs)


def wrong_length(inputs: list[Any]) -> list[Any]:
    """One output too few."""
    return list(inputs)[:-1]


def cuda_devices(inputs: list[Any]) -> list[Any]:
    """What a CUDA library would see: the worker's CUDA_VISIBLE_DEVICES."""
    return [os.environ.get("CUDA_VISIBLE_DEVICES") for _ in inputs]


def crash(inputs: list[Any]) -> list[Any]:
    """Echo, but kill the worker process outright (as a segfault would) on "crash"."""
    if "crash" in inputs:
        os._exit(3)
    return list(inputs)


#: The file whose presence breaks LoadsUnlessBroken (a new version that does not load).
BROKEN_ENV = "BATCHER_TEST_BROKEN_FLAG"


class LoadsUnlessBroken:
    """Echo ({"input": x}); its constructor raises while the file named by $BATCHER_TEST_BROKEN_FLAG
    exists, as a new version of a model whose weights file is missing would."""

    def __init__(self, gpu_id: int | None) -> None:
        flag = os.environ.get(BROKEN_ENV)
        if flag and os.path.exists(flag):
            raise FileNotFoundError(f"weights missing ({flag} exists)")

    def __call__(self, inputs: list[Any]) -> list[Any]:
        return [{"input": x} for x in inputs]


def hang_on(inputs: list[Any]) -> list[Any]:
    """A model that hangs (for an hour) on a batch holding "hang", its heartbeat thread
    alive all the while; any other batch is echoed with the worker's pid."""
    import os
    import time

    if "hang" in inputs:
        time.sleep(3600)
    return [{"input": x, "pid": os.getpid()} for x in inputs]


class LengthSpan:
    """A stacked model padded along axis 0: each request gets the shortest and longest
    true length of the batch it ran in, so a test sees which lengths shared a batch."""

    from workers.stacking import Stack  # here, so that the models above need no numpy

    stack = Stack(pad_axes=(0,), pad_value=0)

    def __init__(self, gpu_id: int | None) -> None:
        self.gpu_id = gpu_id

    def __call__(self, batch: Any, lengths: Any) -> Any:
        import numpy as np

        span = np.array([lengths[:, 0].min(), lengths[:, 0].max()], dtype=np.int64)
        return np.tile(span, (batch.shape[0], 1))


def oip_probe(inputs: list[Any]) -> list[Any]:
    """For the gateway's error tests, on BYTES inputs: b"boom" raises (model_error),
    b"crash" kills the worker (worker_failed), b"slow" holds the batch for 1.5 s,
    b"hold:PATH" holds it until the file PATH exists (30 s at most: a test that needs the
    worker busy for as long as it takes, however loaded the machine); anything else is echoed."""
    import time

    if b"crash" in inputs:
        os._exit(3)
    if b"boom" in inputs:
        raise ValueError("boom")
    if b"slow" in inputs:
        time.sleep(1.5)
    for item in inputs:
        if isinstance(item, bytes) and item.startswith(b"hold:"):
            gate, deadline = item[5:].decode(), time.monotonic() + 30.0
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
    return list(inputs)


class SlowStopLM:
    """simlm at 2 ms a step whose `stop` takes 100 ms (a model freeing a large cache): a
    burst of cancels keeps the worker busy for longer than the heartbeat expiry."""

    step_level = True

    def __init__(self, gpu: int | None = None) -> None:
        from workers.models import SimLM, SimSettings

        self.lm = SimLM(SimSettings(step_base_ms=2.0, step_per_seq_ms=0.0))

    def start(self, items: list[tuple[int, Any]]) -> list[BaseException | None]:
        return self.lm.start(items)

    def step(self) -> list[tuple[int, Any, bool]]:
        return self.lm.step()

    def stop(self, key: int) -> None:
        import time

        time.sleep(0.1)
        self.lm.stop(key)


class NoGil:
    """A model that says it computes without the GIL (`releases_gil`), as ONNX Runtime's
    session does, so the worker runs it on its model thread (workers/overlap.py). It
    echoes its inputs; a batch sleeps (without the GIL) the largest `sleep` of its map
    inputs, and, when BATCHER_TEST_RUNS names a file, appends "start IDS" and "end IDS"
    lines to it (IDS: the inputs' `i`, then the thread's name), so a test sees what ran, and when."""

    releases_gil = True

    def __init__(self, gpu: int | None) -> None:
        self.runs = os.environ.get("BATCHER_TEST_RUNS")

    def __call__(self, inputs: list[Any]) -> list[Any]:
        maps = [x for x in inputs if isinstance(x, dict)]
        ids = " ".join(str(x.get("i")) for x in maps)
        thread = threading.current_thread().name
        self._note(f"start {ids} {thread}")
        time.sleep(max((float(x.get("sleep", 0)) for x in maps), default=0.0))
        self._note(f"end {ids} {thread}")
        return list(inputs)

    def _note(self, line: str) -> None:
        if self.runs:
            with open(self.runs, "a") as f:
                f.write(line + "\n")


class TripleWidth:
    """Signature x FP32 [-1, -1]; each input's sum, but an input whose width is not a
    multiple of 3 fails alone (an exception instance, as the ONNX model answers a run that
    fails): the warm-up's zeros, a dynamic axis taken as 1, fail."""

    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def __init__(self, gpu_id: int | None = None) -> None:
        self.seen_widths: list[int] = []

    def __call__(self, inputs: list[Any]) -> list[Any]:
        out: list[Any] = []
        for x in inputs:
            if x.shape[0] % 3:
                out.append(ValueError(f"width {x.shape[0]} is not a multiple of 3"))
            else:
                out.append(x.sum(keepdims=True))
        return out


class SampledTripleWidth(TripleWidth):
    """TripleWidth with a warm-up sample it accepts (width 3)."""

    @property
    def warmup_sample(self) -> Any:
        import numpy as np

        return np.ones(3, np.float32)


class Counting:
    """Not deterministic (it says so: `deterministic = False`): each output is a new count."""

    deterministic = False

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, inputs: list[Any]) -> list[Any]:
        out = []
        for _ in inputs:
            self.n += 1
            out.append(self.n)
        return out


counting = Counting()
