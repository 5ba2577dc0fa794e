"""A step-level (generative) model in a few lines: docs/generative.md.

`Typewriter` streams its input text back one word per step. The worker keeps up to
--max-active sequences, calls `start` with the new ones between steps, `step` once per
step over all of them, and `stop` for one it ends early (cancelled, past its deadline).
From this directory:

    batcher serve --model typewriter=generative:Typewriter
    batcher send --model typewriter --stream '"continuous batching streams words"'
"""

from __future__ import annotations

from collections import deque
from typing import Any

from workers.steps import BadInput


class Typewriter:
    """Each sequence yields the next word of its text per step; the last one ends it."""

    step_level = True

    def __init__(self, gpu: int | None = None) -> None:
        self.words: dict[int, deque[str]] = {}  # sequence key -> the words still to send

    def start(self, items: list[tuple[int, Any]]) -> list[BaseException | None]:
        verdicts: list[BaseException | None] = []
        for key, text in items:
            if isinstance(text, bytes):  # a BYTES tensor's element, through the HTTP/gRPC gateway
                text = text.decode("utf-8", "replace")
            if not isinstance(text, str) or not text.split():
                verdicts.append(BadInput("the input must be a string of at least one word"))
                continue
            self.words[key] = deque(text.split())
            verdicts.append(None)
        return verdicts

    def step(self) -> list[tuple[int, str, bool]]:
        chunks = []
        for key, words in list(self.words.items()):
            word = words.popleft()
            if not words:  # done: forget it (the worker does not call stop for it)
                del self.words[key]
            chunks.append((key, word, not words))
        return chunks

    def stop(self, key: int) -> None:
        self.words.pop(key, None)
