"""Master-key guessing is limited (security review, item 3): failed admin authentications and console logins share
one counter per client address in Redis, a blocked address is refused before its key is compared, forwarded
addresses are used only when they are IP addresses, a trusted proxy's rotating forwarded addresses hit a backstop
counted per proxy, and `unigate serve` refuses a short `UNIGATE_MASTER_KEY`.

Each test runs the real `unigate serve` (its own embedded Redis) on a loopback port; requests come from
127.0.0.1, which uvicorn trusts by default (`FORWARDED_ALLOW_IPS`), so `X-Forwarded-For` names the client.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fakes.app import MASTER
from fakes.net import free_port

MAX_PER_MIN = 3  # UNIGATE_CONSOLE__MAX_LOGINS_PER_MIN in these tests; a proxy's backstop is 10x that
WRONG = "sk-ug-wrong-key-guess-0123456789abcdef"


@dataclass
class Gateway:
    process: subprocess.Popen[str]
    url: str

    def admin(self, key: str, forwarded_for: str | None = None, *, header: str = "authorization") -> httpx.Response:
        headers = {header: f"Bearer {key}" if header == "authorization" else key}
        if forwarded_for is not None:
            headers["x-forwarded-for"] = forwarded_for
        return httpx.get(f"{self.url}/admin/usage", headers=headers, timeout=10)

    def login(self, key: str, forwarded_for: str) -> httpx.Response:
        headers = {"x-forwarded-for": forwarded_for}
        return httpx.post(f"{self.url}/ui/api/login", json={"master_key": key}, headers=headers, timeout=10)

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, stderr = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate(timeout=10)
        return stderr


def serve_command() -> list[str]:
    return [sys.executable, "-c", "from gateway.cli import main; main()", "serve"]


def serve_env(tmp_path: Path, port: int, **env: str) -> dict[str, str]:
    """Only these UNIGATE_* variables (no .env: the command runs in an empty directory)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UNIGATE_") and k != "FORWARDED_ALLOW_IPS"}
    return clean | {
        "UNIGATE_DATA_DIR": str(tmp_path / "data"),
        "UNIGATE_PORT": str(port),
        "UNIGATE_ENGINE__ENABLED": "false",
        "UNIGATE_HEALTH_PROBE_INTERVAL_S": "0",
        "UNIGATE_CONSOLE__MAX_LOGINS_PER_MIN": str(MAX_PER_MIN),
        **env,
    }


def start_gateway(tmp_path: Path, **env: str) -> Gateway:
    port = free_port()
    process = subprocess.Popen(
        serve_command(), env=serve_env(tmp_path, port, **env), cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    gateway = Gateway(process, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise AssertionError(f"the gateway exited while starting:\n{gateway.stop()[-3000:]}")
        try:
            if httpx.get(f"{gateway.url}/health/live", timeout=2).status_code == 200:
                return gateway
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the gateway did not start:\n{gateway.stop()[-3000:]}")
        time.sleep(0.05)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gateway = start_gateway(tmp_path, UNIGATE_MASTER_KEY=MASTER)
    yield gateway
    gateway.stop()


def assert_blocked(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert MASTER not in response.text and WRONG not in response.text


def test_wrong_master_keys_block_the_address_even_for_the_right_key(gateway: Gateway) -> None:
    for header in ("authorization", "x-api-key", "authorization")[:MAX_PER_MIN]:
        assert gateway.admin(WRONG, "203.0.113.7", header=header).status_code == 401
    assert_blocked(gateway.admin(WRONG, "203.0.113.7"))
    assert_blocked(gateway.admin(MASTER, "203.0.113.7"))  # refused before the key is compared
    assert_blocked(gateway.admin(MASTER, "203.0.113.7", header="x-api-key"))
    for _ in range(MAX_PER_MIN + 2):  # another address is served, and right keys are never counted
        assert gateway.admin(MASTER, "203.0.113.8").status_code == 200
    assert gateway.admin(MASTER).status_code == 200  # the proxy's own address (no X-Forwarded-For) too


def test_wrong_admin_keys_and_console_logins_share_one_counter(gateway: Gateway) -> None:
    created = httpx.post(f"{gateway.url}/admin/keys", json={}, headers={"authorization": f"Bearer {MASTER}"})
    normal_key = created.json()["key"]
    assert gateway.login(WRONG, "198.51.100.1").status_code == 401
    assert gateway.admin(normal_key, "198.51.100.1").status_code == 403  # a normal key is a wrong master key too
    assert gateway.login(WRONG, "198.51.100.1").status_code == 401
    assert_blocked(gateway.admin(MASTER, "198.51.100.1"))
    assert_blocked(gateway.login(MASTER, "198.51.100.1"))
    # and the other way round: failed admin keys use up the console's logins
    for _ in range(MAX_PER_MIN):
        assert gateway.admin(WRONG, "198.51.100.2").status_code == 401
    assert_blocked(gateway.login(MASTER, "198.51.100.2"))
    assert gateway.login(MASTER, "198.51.100.3").status_code == 200


def test_rotating_forwarded_addresses_hit_the_proxy_backstop(gateway: Gateway) -> None:
    backstop = 10 * MAX_PER_MIN
    for n in range(backstop):  # one failure per forwarded address: never over the per-address limit
        assert gateway.admin(WRONG, f"192.0.2.{n + 1}").status_code == 401
    assert_blocked(gateway.admin(MASTER, "192.0.2.200"))  # a fresh address behind the same proxy
    assert_blocked(gateway.login(MASTER, "192.0.2.201"))
    assert gateway.admin(MASTER).status_code == 200  # the proxy's own address has its own (unused) window


@pytest.mark.parametrize(
    "forwarded_for",
    ["1" * 60_000, "not-an-address", "2001:db8::1" + "0" * 50, "203.0.113.9, ::ffff:zz"],
    ids=["60000-chars", "a-word", "too-long-ipv6", "last-hop-not-an-ip"],
)
def test_a_forwarded_value_that_is_not_an_ip_address_counts_under_the_peer(
    gateway: Gateway, forwarded_for: str
) -> None:
    for _ in range(MAX_PER_MIN):
        assert gateway.admin(WRONG, forwarded_for).status_code == 401
    blocked = gateway.admin(MASTER)  # the connection's own address (127.0.0.1) was counted
    assert_blocked(blocked)
    assert forwarded_for[:20] not in blocked.text
    assert gateway.admin(MASTER, "203.0.113.10").status_code == 200  # a real forwarded address is its own


def test_serve_refuses_a_short_master_key_unless_allowed(tmp_path: Path) -> None:
    weak = "sk-ug-weak-key-12345"  # 20 characters
    result = subprocess.run(
        serve_command(),
        env=serve_env(tmp_path, free_port(), UNIGATE_MASTER_KEY=weak),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "UNIGATE_MASTER_KEY" in result.stderr and "32" in result.stderr
    assert "UNIGATE_ALLOW_WEAK_MASTER_KEY" in result.stderr
    assert weak not in result.stderr + result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()  # refused before anything started

    gateway = start_gateway(tmp_path, UNIGATE_MASTER_KEY=weak, UNIGATE_ALLOW_WEAK_MASTER_KEY="true")
    try:
        assert gateway.admin(weak).status_code == 200
    finally:
        stderr = gateway.stop()
    assert "UNIGATE_MASTER_KEY is shorter than 32 characters" in stderr and weak not in stderr
