"""Route families, each a plain list of Starlette routes."""

from __future__ import annotations

from gateway.routes.health import health_routes
from gateway.routes.openai import JSONBytesResponse, openai_routes, read_json_body

__all__ = ["JSONBytesResponse", "health_routes", "openai_routes", "read_json_body"]
