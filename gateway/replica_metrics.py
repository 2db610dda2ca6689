"""Each replica's own load, read from its `metrics_url` on the gateway's schedule: `ReplicaMetricsPoller`.

A background task of the app's lifespan, like the health probes. Every `router.metrics_interval_s` it fetches, at
once, the Prometheus text of every deployment that has a `metrics_url` and belongs to a model with `routing:
least_load` or `prefix_affinity`, under `router.metrics_timeout_s`, and writes what it read into the deployment's
`ReplicaLoad` (gateway/routing_policies.py):

- running: `vllm:num_requests_running`, `sglang:num_running_reqs`, `unigate_engine_running_seqs`;
- waiting: `vllm:num_requests_waiting`, `sglang:num_queue_reqs`, `unigate_engine_waiting_seqs`;
- KV cache in use (0..1): `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`), `sglang:token_usage`,
  `unigate_engine_kv_blocks_used` / `unigate_engine_kv_blocks_total` (vLLM, SGLang, `unigate engine serve`).

Series with labels (one per model name, per engine) are summed. A poll that is not answered in time, or not with
200, counts as failed; after `MAX_METRICS_FAILS` failures in a row the replica gets no new requests until a poll
succeeds. An answer without a running count is a missing signal: the replica stays in rotation and the router uses
its in-flight count for it. The deployment's `api_key` goes with the poll only when `metrics_url` has the origin of
its `base_url` (vLLM's `--api-key` and `unigate engine serve --api-key` guard their own host).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from gateway.router import Deployment, Router
from gateway.routing_policies import MAX_METRICS_FAILS

__all__ = ["ReplicaMetricsPoller", "parse_load"]

logger = logging.getLogger("unigate.replica_metrics")

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "unigate_engine_running_seqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "unigate_engine_waiting_seqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_KV_BLOCKS = ("unigate_engine_kv_blocks_used", "unigate_engine_kv_blocks_total")
_MAX_METRICS_BYTES = 4 << 20  # a replica's metrics page; a larger answer counts as a failed poll


def parse_load(text: str) -> tuple[float, float, float] | None:
    """`(running, waiting, kv_cache_usage)` from Prometheus text; None when no running count is in it."""
    sums: dict[str, float] = {}
    wanted = {*_RUNNING, *_WAITING, *_KV_USAGE, *_KV_BLOCKS}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        end = line.find("{")
        if end < 0:
            name, _, rest = line.partition(" ")
        else:
            name, rest = line[:end], line[line.rfind("}") + 1 :]
        if name not in wanted:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            sums[name] = sums.get(name, 0.0) + value
    running = next((sums[n] for n in _RUNNING if n in sums), None)
    if running is None:
        return None
    waiting = next((sums[n] for n in _WAITING if n in sums), 0.0)
    kv_usage = next((sums[n] for n in _KV_USAGE if n in sums), None)
    if kv_usage is None:
        used, total = (sums.get(n, 0.0) for n in _KV_BLOCKS)
        kv_usage = used / total if total > 0 else 0.0
    return max(0.0, running), max(0.0, waiting), min(1.0, max(0.0, kv_usage))


class ReplicaMetricsPoller:
    """Polls the replicas' `metrics_url` (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the router's (a report's age is measured on it)."""
        self.router: Router | None = None
        self.num_rounds = 0
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def deployments(self) -> list[Deployment]:
        """The deployments it polls."""
        routes = self.router.routes if self.router is not None else []
        return [d for r in routes if r.reads_replicas for d in r.deployments if d.config.metrics_url]

    def start(self, router: Router) -> None:
        """Poll `router`'s replicas from now on (nothing runs when no deployment has a `metrics_url` under a policy
        that reads it)."""
        self.router = router
        if self._task is None and self.deployments:
            self._task = asyncio.create_task(self._run(), name="unigate-replica-metrics")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def poll_once(self) -> None:
        """One round: read every polled replica's metrics, at once."""
        assert self.router is not None, "start() first"
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.router.config.metrics_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout)
        deployments = self.deployments
        await asyncio.gather(*(self._poll(d) for d in deployments))
        self.num_rounds += 1

    async def _run(self) -> None:
        assert self.router is not None
        while True:
            try:
                await self.poll_once()
            except Exception:  # a bug here must not end polling for the life of the process
                logger.exception("replica metrics round failed")
            await asyncio.sleep(self.router.config.metrics_interval_s)

    async def _poll(self, deployment: Deployment) -> None:
        replica = deployment.replica
        in_flight = deployment.num_in_flight
        text = await self._fetch(deployment)
        if text is None:
            replica.num_failed_polls += 1
            if replica.num_failed_polls == MAX_METRICS_FAILS:
                logger.warning("deployment %s stopped answering its metrics; no new requests", deployment.name)
            return
        if replica.num_failed_polls >= MAX_METRICS_FAILS:
            logger.warning("deployment %s answers its metrics again", deployment.name)
        replica.num_failed_polls = 0
        load = parse_load(text)
        if load is None:
            return  # a missing signal: its `read_at` ages and the router counts in-flight requests instead
        replica.num_running, replica.num_waiting, replica.kv_cache_usage = load
        replica.num_in_flight_at_read = in_flight
        replica.read_at = self._clock()

    async def _fetch(self, deployment: Deployment) -> str | None:
        config = deployment.config
        assert config.metrics_url is not None and self._session is not None
        headers = {}
        if config.api_key and config.base_url and _origin(config.base_url) == _origin(config.metrics_url):
            headers["authorization"] = f"Bearer {config.api_key}"
        try:
            async with self._session.get(config.metrics_url, headers=headers, allow_redirects=False) as response:
                if response.status != 200:
                    return None
                body = await response.content.read(_MAX_METRICS_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        if len(body) > _MAX_METRICS_BYTES:
            return None
        return body.decode("utf-8", "replace")


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", parts.port
