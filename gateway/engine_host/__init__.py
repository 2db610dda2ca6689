"""The engine host: one local deployment's engine in a process of its own, shared by the workers of
`unigate serve --workers N` over a Unix socket, and the engine served alone over HTTP (`unigate engine serve`).

    process.py   the parent's side: start each engine process, restart one that dies, stop them after the workers
    main.py      the engine process: bind the owner-only socket, load the model, serve it until SIGTERM
    host.py      EngineHost: the local backend's calls over the engine protocol (`backends.engine_protocol`)
    http.py      `unigate engine serve`: the gateway app with the local engine as its one model

The workers' side is `backends.engine_client.EngineClient`; it and the host share only the protocol module. The
engine process imports no web app (no `gateway.app`, routes or middleware: tests/test_architecture.py), so this
package's `__init__` imports none of its modules.
"""

from __future__ import annotations

__all__: list[str] = []
