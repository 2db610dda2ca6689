"""Fixtures for the gateway tests (helpers live in tests/fakes/ so other folders can use them)."""

from __future__ import annotations

from fakes.fixtures import fake_upstream, fake_upstream_factory, gateway_server  # noqa: F401
