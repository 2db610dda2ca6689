"""The router's background work, started once the router is built and stopped before its backends close: health
probes of the deployments (gateway/health_probe.py), the replicas' metrics polls (gateway/replica_metrics.py) and,
with Redis, prefix_affinity's moves shared with the other gateway instances (gateway/placement_sync.py)."""

from __future__ import annotations

from auth.access import RedisAccess
from auth.base import AccessControl
from gateway.health_probe import HealthProber
from gateway.placement_sync import PlacementSync
from gateway.replica_metrics import ReplicaMetricsPoller
from gateway.router import Router
from gateway.routing_policies import MAX_PLACEMENTS
from gateway.settings import Settings

__all__ = ["RouterTasks"]


class RouterTasks:
    def __init__(self, router: Router, settings: Settings, access: AccessControl, poller: ReplicaMetricsPoller) -> None:
        self.router = router
        self.prober = HealthProber(
            router, interval_s=settings.health_probe_interval_s, timeout_s=settings.health_probe_timeout_s
        )
        self.poller = poller
        self.placements = (
            PlacementSync(access.redis, router, max_placements=MAX_PLACEMENTS)
            if isinstance(access, RedisAccess)
            else None
        )

    def start(self) -> None:
        self.prober.start()
        self.poller.start(self.router)
        if self.placements is not None:
            self.placements.start()

    async def stop(self) -> None:
        await self.prober.stop()
        await self.poller.stop()
        if self.placements is not None:
            await self.placements.aclose()
