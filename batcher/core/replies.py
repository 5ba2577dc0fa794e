"""The reply table: one peer's requests waiting for their replies, by request id.

Every face that sends requests over one DEALER and matches the replies that come back
(Client, AsyncClient, the gateway's BrokerLink, bench's load generator) keeps one: it
hands out the ids (1, 2, ...), holds what waits for each reply (a PendingReply, an
asyncio future, the time a bench request was due), gives a decoded reply's id its
waiter, forgets a request given up on, and hands every waiter over at once when the
connection or the client is gone. What a waiter is, and how it is answered, is the
caller's: the table never looks inside one. Pure: no socket, no event loop, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

WaiterT = TypeVar("WaiterT")


def reply_key(reply: Mapping[str, Any], pending: Mapping[Any, Any]) -> Any:
    """The id a reply answers. An error with `id: nil` (the broker could not read the id
    of a request it refused) answers the one request in flight, when there is just one."""
    req_id = reply["id"]
    if req_id is None and reply.get("ok") is False and len(pending) == 1:
        return next(iter(pending))
    return req_id


class ReplyTable(Generic[WaiterT]):
    """Request ids, and what waits for each one's reply. Ids are this table's own, from 1;
    a reply is matched once (a second reply to the same id, or one to an id forgotten or
    never sent, matches nothing and is counted in `unmatched`)."""

    __slots__ = ("_ids", "_waiting", "unmatched")

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._waiting: dict[Any, WaiterT] = {}
        #: Replies that matched no waiter: a retried request's second reply, a late one to
        #: a request given up on, or one a caller found already answered (it adds those).
        self.unmatched = 0

    def new_id(self) -> int:
        """An id not handed out before by this table (1, 2, ...)."""
        return next(self._ids)

    def add(self, req_id: Any, waiter: WaiterT) -> WaiterT:
        """Wait for the reply to `req_id` with `waiter` (returned, for chaining)."""
        self._waiting[req_id] = waiter
        return waiter

    def open(self, waiter: WaiterT) -> int:
        """A new id, with `waiter` waiting for its reply: `new_id` and `add` in one."""
        req_id = next(self._ids)
        self._waiting[req_id] = waiter
        return req_id

    def __len__(self) -> int:
        """Requests waiting for a reply."""
        return len(self._waiting)

    def __contains__(self, req_id: Any) -> bool:
        return req_id in self._waiting

    def get(self, req_id: Any) -> WaiterT | None:
        """The waiter of `req_id`, left waiting (None: none waits)."""
        return self._waiting.get(req_id)

    def match(self, req_id: Any) -> WaiterT | None:
        """Take the waiter of the reply to `req_id` out of the table; None when none
        waits for it, counted in `unmatched`. Raises TypeError for an id that cannot be
        one (unhashable): the caller skips that reply, uncounted."""
        waiter = self._waiting.pop(req_id, None)
        if waiter is None:
            self.unmatched += 1
        return waiter

    def match_reply(self, reply: Mapping[str, Any]) -> WaiterT | None:
        """`match` for a decoded reply map, by its id or by the nil-id rule of `reply_key`.
        Raises (KeyError, TypeError) for what is no reply map at all, uncounted."""
        req_id = reply["id"]
        if req_id is None:
            req_id = reply_key(reply, self._waiting)
        return self.match(req_id)

    def forget(self, req_id: Any) -> WaiterT | None:
        """Stop waiting for `req_id` (a reply that still comes is unmatched); its waiter,
        if one waited, for the caller to answer or drop."""
        return self._waiting.pop(req_id, None)

    def release(self, req_id: Any, waiter: WaiterT) -> None:
        """Forget `req_id` if `waiter` is still what waits for it (and not another, or
        none: the table was emptied since)."""
        if self._waiting.get(req_id) is waiter:
            del self._waiting[req_id]

    def take_all(self) -> dict[Any, WaiterT]:
        """Every waiter at once, by id, the table left empty (the connection or the
        client is gone: the caller answers each)."""
        waiting, self._waiting = self._waiting, {}
        return waiting
