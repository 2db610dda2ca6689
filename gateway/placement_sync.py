"""`routing: prefix_affinity`'s placements shared between gateway instances.

Every instance ranks a conversation's replicas the same way (rendezvous hashing over its affinity key), so they
agree where a conversation goes as long as it stays there. They disagree after a move: when load pushes a
conversation off its replica, the instance that moved it remembers the new place (`ModelRoute.placements`) and the
others do not, so the next turn through another instance may go back to a replica whose cache no longer holds the
conversation's latest prefix (two gateways on 16 simulated replicas lost 0.5-2.5 points of cache hit rate).

So a move is published: an instance that sends a key elsewhere than where it last sent it, or a new key elsewhere
than its first choice, queues `(model, key, deployment)`; a background task PUBLISHes what is queued on
`ug:placements` (one message per batch, without waiting on the request), and every instance applies the others'
moves to its own map. A request never waits on Redis for this: an instance that has not yet heard of a move
(a millisecond or so) routes as before, and a gap in the subscription only costs hits, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

import orjson
from redis.exceptions import RedisError

from auth import redis_names
from auth.redis_client import RedisClient, listen
from auth.upstream import cancel_until_done

if TYPE_CHECKING:
    from gateway.router import ModelRoute, Router

__all__ = ["PlacementSync"]

log = logging.getLogger("unigate.placements")

MAX_BATCH = 500  # moves per message


class PlacementSync:
    def __init__(self, redis: RedisClient, router: Router, *, max_placements: int) -> None:
        self._redis = redis
        self._max_placements = max_placements
        self._routes = {route.id: route for route in router.routes if route.config.routing == "prefix_affinity"}
        self._instance = os.urandom(8).hex()  # its own messages come back to it: skipped
        self._queue: list[tuple[str, str, str]] = []
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._is_closing = False
        self.num_published = 0
        self.num_applied = 0
        for route in self._routes.values():
            route.on_move = self.moved

    @property
    def is_needed(self) -> bool:
        return bool(self._routes)

    def moved(self, route: ModelRoute, key: bytes, deployment: str) -> None:
        """Queue a move for the other instances (never waits)."""
        if len(self._queue) < 10 * MAX_BATCH:  # Redis down for long: later moves are not shared, routing goes on
            self._queue.append((route.id, key.hex(), deployment))
            self._wake.set()

    def start(self) -> None:
        if self._routes and not self._tasks:
            for run, name in ((self._publish, "placements-publish"), (self._listen, "placements-listen")):
                self._tasks.add(asyncio.get_running_loop().create_task(run(), name=name))

    async def aclose(self) -> None:
        self._is_closing = True
        self._wake.set()
        if self._tasks:
            await cancel_until_done(self._tasks, timeout_s=3.0)
        self._tasks.clear()

    async def _publish(self) -> None:
        while not self._is_closing:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and not self._is_closing:
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
                try:
                    await self._redis.publish(redis_names.PLACEMENTS_CHANNEL, orjson.dumps([self._instance, batch]))
                    self.num_published += len(batch)
                except (RedisError, OSError) as error:
                    log.debug("placements not shared (%s): %d moves", error, len(batch))
                    await asyncio.sleep(0.5)

    async def _listen(self) -> None:
        await listen(self._redis, redis_names.PLACEMENTS_CHANNEL, self.apply, is_closing=lambda: self._is_closing)

    def apply(self, data: bytes) -> None:
        """Another instance's moves, into this instance's placements (what is not understood is skipped)."""
        try:
            instance, moves = orjson.loads(data)
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return
        if instance == self._instance or not isinstance(moves, list):
            return
        for move in moves:
            try:
                model, key_hex, deployment = move
                route = self._routes.get(model)
                if route is None or all(d.name != deployment for d in route.deployments):
                    continue
                key = bytes.fromhex(key_hex)
            except (TypeError, ValueError):
                continue
            placements = route.placements
            placements[key] = deployment
            placements.move_to_end(key)
            if len(placements) > self._max_placements:
                placements.popitem(last=False)
            self.num_applied += 1
