"""Deployment health on the gateway's own schedule: `/health/ready` reports it, and nobody's request decides it.

`HealthProber` is a background task of the app's lifespan. Every `health_probe_interval_s` (0 = never; the first
round comes one interval after start-up) it calls each deployment's `check_health()` under
`health_probe_timeout_s`, concurrently; a failed probe takes that deployment out of rotation for one cooldown
(`Router.mark_down`). A backend that knows its own state (`ReportsHealthState`: the local engine) is never probed
nor marked down: `loading` and `restarting` are states, not failures, and its requests get its own answer.

States: `up`, `down` (the last probe failed, or the engine is dead), `cooling_down` (the router took it out after
failures), `loading`, `restarting`, `load_failed` (a local model that could not be loaded; `reasons()` gives the
error code its requests get, e.g. `checkpoint_not_found`). Before its first probe a deployment counts as `up`, as
the router treats it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from backends.base import Backend, ReportsEngineStats, ReportsHealthState
from gateway.router import Deployment, Router

__all__ = ["HealthProber"]

logger = logging.getLogger("unigate.health")


class HealthProber:
    def __init__(self, router: Router, *, interval_s: float, timeout_s: float) -> None:
        self.router = router
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.num_rounds = 0
        self._is_failing: dict[str, bool] = {}  # deployment name -> its last probe failed
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the probe loop (a no-op when `interval_s` is 0)."""
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="unigate-health-probe")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def states(self) -> dict[str, str]:
        """Each deployment's last known state; no I/O."""
        states: dict[str, str] = {}
        for deployment in self.router.deployments:
            backend = deployment.backend
            if isinstance(backend, ReportsHealthState):
                state: str = backend.health_state()
                if state == "down" and _load_error(backend) is not None:
                    state = "load_failed"
            else:
                state = "down" if self._is_failing.get(deployment.name) else "up"
            if state == "up" and self.router.is_cooling(deployment):
                state = "cooling_down"
            states[deployment.name] = state
        return states

    def reasons(self) -> dict[str, str]:
        """Why each `load_failed` deployment is so: the error code its requests get; no I/O."""
        reasons: dict[str, str] = {}
        for deployment in self.router.deployments:
            backend = deployment.backend
            if isinstance(backend, ReportsHealthState) and backend.health_state() == "down":
                error = _load_error(backend)
                if error is not None:
                    reasons[deployment.name] = error
        return reasons

    async def probe_once(self) -> None:
        """One round: probe every deployment that has no state of its own; mark the failed ones down."""
        deployments = [d for d in self.router.deployments if not isinstance(d.backend, ReportsHealthState)]
        results = await asyncio.gather(*(self._probe(d) for d in deployments))
        for deployment, is_ok in zip(deployments, results, strict=True):
            self._is_failing[deployment.name] = not is_ok
            if not is_ok:
                logger.warning("health probe of deployment %s failed; it cools down", deployment.name)
                self.router.mark_down(deployment)
        self.num_rounds += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe_once()
            except Exception:  # a bug here must not end health probing for the life of the process
                logger.exception("health probe round failed")

    async def _probe(self, deployment: Deployment) -> bool:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                return await deployment.backend.check_health()
        return False


def _load_error(backend: Backend) -> str | None:
    """The code of a local model's failed load (from its stats: `load_failed`, `load_error`), else None."""
    if not isinstance(backend, ReportsEngineStats):
        return None
    stats = backend.stats()
    return str(stats.get("load_error") or "engine_error") if stats.get("load_failed") else None
