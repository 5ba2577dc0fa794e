"""A worker's failed handshakes with its broker (a wrong CURVE key, a broker that refuses
it): counted in a row, and logged so that a worker left refused for days does not flood
its log, while the first refusal and the recovery are always said at WARNING and INFO."""

from __future__ import annotations

import logging

log = logging.getLogger("batcher.worker")

#: A refused handshake is logged at WARNING once, then again at most this often (DEBUG between).
REFUSAL_LOG_EVERY_S = 60.0


class Refusals:
    """The failed handshakes in a row of worker `name` with the broker at `connect`."""

    def __init__(self, name: str, connect: str) -> None:
        self.name, self.connect = name, connect
        self.count = 0  # handshakes failed in a row
        self._logged: tuple[str, float] | None = None  # (why, when) of the last warning

    def failed(self, why: str, now: float, retry_s: float) -> None:
        """A failed handshake: WARNING the first time, then at most every REFUSAL_LOG_EVERY_S
        for the same reason (DEBUG in between)."""
        self.count += 1
        last = self._logged
        again = last is not None and last[0] == why and now - last[1] < REFUSAL_LOG_EVERY_S
        if not again:
            self._logged = (why, now)
        log.log(
            logging.DEBUG if again else logging.WARNING,
            "worker %s cannot join the broker at %s: %s; retrying in %.2gs (failed handshakes: %d)",
            self.name,
            self.connect,
            why,
            retry_s,
            self.count,
        )

    def accepted(self) -> None:
        """A handshake succeeded: said at INFO after refusals, and the count starts again."""
        if self.count:
            log.info(
                "worker %s: the broker at %s accepted us after %d failed handshakes",
                self.name,
                self.connect,
                self.count,
            )
        self.count, self._logged = 0, None
