"""A fake OpenAI-compatible upstream: a real HTTP/1.1 server on a loopback port that misbehaves on request.

It is a raw asyncio server running its own event loop in a daemon thread, so it works under any test loop and
can break the protocol on purpose (drop the connection, cut a chunked stream, send HTML with status 200).

    upstream = FakeUpstream().start()          # or the `fake_upstream` fixture in tests/fakes/fixtures.py
    upstream.base_url                          # "http://127.0.0.1:<port>/v1"
    upstream.behave(mode="slow", ttft_s=0.2)   # the default behaviour for every following request
    upstream.queue(Behavior(mode="status", status=500), Behavior())  # one-shot behaviours, used first, in order
    upstream.requests                          # [RecordedRequest(method, path, headers, body)] in arrival order
    upstream.model_ids = ["gpt-x", "gpt-y"]    # what GET /v1/models lists (default ["fake"])
    upstream.models_behavior = Behavior(mode="status", status=500)  # GET /v1/models: status | html | hang
    upstream.num_open_streams                  # streams being written right now
    upstream.num_streams_aborted               # streams whose client closed the connection before the end
    upstream.stop()

Endpoints: POST /v1/chat/completions, /v1/completions, /v1/embeddings (any other POST path answers like chat),
GET /v1/models. Streams send `num_chunks` content chunks `"t0 "`, `"t1 "`, ..., a finish chunk, a usage chunk
when the request set `stream_options.include_usage`, then `[DONE]`. Usage is always
`prompt_tokens=PROMPT_TOKENS`, `completion_tokens=num_chunks`.

Modes (`Behavior.mode`):
    normal            well-formed responses (with `ttft_s` / `inter_token_s` delays when set: "slow")
    slow              same as normal; set `ttft_s` (before the headers) and `inter_token_s` (between chunks)
    status            answer `status` with an OpenAI error body (and `Retry-After: retry_after` when set)
    drop              read the request, then close the connection without answering
    html              status 200 with an HTML page
    malformed         status 200 with a broken JSON body; `variant` one of MALFORMED_VARIANTS
    stream_cut        stream `cut_after` chunks, then close the connection mid-body; with `cut_when` (a
                      `threading.Event`) the close waits until the test sets it (or `hold_s` passes). A test that
                      asserts what arrived before the cut needs this: it sets the event once its client has seen
                      those events. Cut at once, the close can overtake them: the gateway's HTTP client (aiohttp)
                      raises the payload error before handing over bytes it received but had not read yet.
    malformed_chunk   stream `cut_after` chunks, then one broken chunk (`variant`: not_json | no_delta |
                      choices_not_list), then [DONE]
    error_chunk       stream `cut_after` chunks, then `data: {"error": {...}}`
    redirect          answer `status` (302, 307, ...) with `Location: location`; as the default behaviour, GET
                      /v1/models redirects too
    huge              status 200 with a valid chat completion of about `size` bytes; `variant`: "" (content-length),
                      "chunked" (no length), "gzip" (content-encoding: gzip, inflating to `size`: a compression bomb)
    sse_huge          stream `cut_after` chunks, then a `data:` line of `size` bytes that never ends
    sse_comments      stream `cut_after` chunks, then only SSE comments (every `inter_token_s`, default 0.05 s)
    hang              read the request, then answer nothing
The last three hold the connection until the client closes it (then `client_gone` is set) or `hold_s` passes.
Run standalone (benchmarks): `python tests/fakes/upstream.py --port 9000`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gzip
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["MALFORMED_VARIANTS", "PROMPT_TOKENS", "Behavior", "FakeUpstream", "RecordedRequest"]

PROMPT_TOKENS = 7
MALFORMED_VARIANTS = (
    "not_json",  # body is not JSON at all
    "no_choices",  # object without `choices`
    "empty_choices",  # `choices: []`
    "choices_not_list",  # `choices: {...}`
    "choice_not_object",  # `choices: ["text"]`
    "no_message",  # a choice without `message` / `text`
    "wrong_types",  # `message.content` is a number
    "array_body",  # the body is a JSON array
    "tool_call_types",  # `tool_calls: [{"id": 5, "function": 7}]`
    # repairable (the gateway fixes these and answers 200):
    "missing_index",
    "missing_finish_reason",
    "tool_calls_no_content",
    "tool_calls_arguments_object",  # `arguments` an object, not its JSON text
)


@dataclass
class Behavior:
    mode: str = "normal"
    status: int = 200
    retry_after: str | None = None
    ttft_s: float = 0.0
    inter_token_s: float = 0.0
    num_chunks: int = 3
    cut_after: int = 1
    variant: str = ""
    content: str = "Hello from the fake upstream"
    location: str = ""
    size: int = 0
    hold_s: float = 60.0
    usage: dict[str, Any] | None = None  # reported instead of the default usage (e.g. absurd figures)
    message: str = ""  # status / error_chunk: the upstream's error message instead of the default one
    cut_when: threading.Event | None = None  # stream_cut: cut only once this is set (see the module docstring)


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    received_at: float = field(default_factory=time.monotonic)


class FakeUpstream:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.default = Behavior()
        self.requests: list[RecordedRequest] = []
        self.model_ids: list[str] = ["fake"]
        self.models_behavior: Behavior | None = None  # GET /v1/models: None = the list; `status`, `html`, `hang`
        self.num_open_streams = 0
        self.num_streams_aborted = 0
        self.num_streams_completed = 0
        self.num_connections = 0
        self.is_recording = True
        self.client_gone = threading.Event()  # a client closed a connection the fake was holding open (hold modes)
        self._queue: deque[Behavior] = deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None

    # --- control (thread-safe) ---------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def behave(self, behavior: Behavior | None = None, **fields: Any) -> FakeUpstream:
        self.default = behavior or Behavior(**fields)
        return self

    def queue(self, *behaviors: Behavior) -> FakeUpstream:
        with self._lock:
            self._queue.extend(behaviors)
        return self

    def reset(self) -> None:
        with self._lock:
            self._queue.clear()
            self.requests.clear()
        self.default = Behavior()
        self.model_ids, self.models_behavior = ["fake"], None
        self.num_streams_aborted = self.num_streams_completed = 0
        self.client_gone.clear()

    def start(self) -> FakeUpstream:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="fake-upstream", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake upstream did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None

    def __enter__(self) -> FakeUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- server ------------------------------------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        server = loop.run_until_complete(asyncio.start_server(self._handle, self.host, self.port, backlog=1024))
        self._server = server
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    def _next_behavior(self) -> Behavior:
        with self._lock:
            return self._queue.popleft() if self._queue else self.default

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers: dict[str, str] = {}
                for line in header_lines:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(length) if length else b""
                try:
                    body = orjson.loads(raw) if raw else None
                except orjson.JSONDecodeError:
                    body = raw
                if self.is_recording:
                    self.requests.append(RecordedRequest(method, path, headers, body))
                is_open = await self._respond(reader, writer, method, path, body)
                if not is_open:
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            return
        except asyncio.CancelledError:
            # Stopped with the connection open: end as finished. On Python 3.11 `start_server` logs a traceback
            # for every connection task that ends cancelled (thousands in a benchmark's output).
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _respond(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, path: str, body: Any
    ) -> bool:
        if method == "GET":
            if self.default.mode == "redirect":
                _write(writer, self.default.status, b"", extra_headers={"location": self.default.location})
                return True
            listing = self.models_behavior
            if listing is not None and listing.mode == "status":
                return self._write_status(writer, listing)
            if listing is not None and listing.mode == "html":
                _write(writer, 200, b"<html><body>Sign in</body></html>", content_type="text/html")
                return True
            if listing is not None and listing.mode == "hang":
                await self._hold(reader, writer, listing, {}, "models")
                return False
            data = [{"id": model_id, "object": "model", "owned_by": "fake"} for model_id in self.model_ids]
            _write(writer, 200, orjson.dumps({"object": "list", "data": data}))
            return True
        behavior = self._next_behavior()
        if behavior.ttft_s:
            await asyncio.sleep(behavior.ttft_s)
        request = body if isinstance(body, dict) else {}
        endpoint = _endpoint(path)
        mode = behavior.mode
        if mode == "drop":
            writer.transport.abort()
            return False
        if mode == "status":
            return self._write_status(writer, behavior)
        if mode == "html":
            page = b"<html><body><h1>502 Bad Gateway</h1>nginx</body></html>"
            _write(writer, 200, page, content_type="text/html")
            return True
        if mode == "malformed":
            _write(writer, 200, _malformed_body(behavior.variant, request))
            return True
        if mode == "redirect":
            body = orjson.dumps({"error": {"message": f"moved to {behavior.location}"}})
            _write(writer, behavior.status, body, extra_headers={"location": behavior.location})
            return True
        if mode == "huge":
            _write_huge(writer, behavior, request)
            return True
        if mode in ("sse_huge", "sse_comments", "hang"):
            await self._hold(reader, writer, behavior, request, endpoint)
            return False
        if request.get("stream") and endpoint != "embeddings":
            return await self._stream(reader, writer, behavior, request, endpoint)
        _write(writer, 200, orjson.dumps(_response(endpoint, request, behavior)))
        return True

    def _write_status(self, writer: asyncio.StreamWriter, behavior: Behavior) -> bool:
        """An error status; `variant` is the upstream's error code, or a provider's shape: "anthropic:<type>" or
        "google:<reason>" (Google answers a bad key with 400 INVALID_ARGUMENT, reason API_KEY_INVALID)."""
        message = behavior.message or f"fake upstream error {behavior.status}"
        error: dict[str, Any] = {"message": message, "type": "api_error", "code": None}
        body: dict[str, Any] = {"error": error}
        if behavior.status == 401:
            error["message"] = "Incorrect API key provided: sk-upstr********cret."
        kind, _, name = behavior.variant.rpartition(":")
        if kind == "anthropic":
            body = {"type": "error", "error": {"type": name, "message": behavior.message or f"fake {name}"}}
        elif kind == "google":
            error.update(code=behavior.status, status="INVALID_ARGUMENT", message="API key not valid.")
            error["details"] = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": name}]
        elif name:
            error["code"] = name
        extra = {"retry-after": behavior.retry_after} if behavior.retry_after else {}
        _write(writer, behavior.status, orjson.dumps(body), extra_headers=extra)
        return True

    async def _stream(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        behavior: Behavior,
        request: dict[str, Any],
        endpoint: str,
    ) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"cache-control: no-cache\r\n\r\n"
        )
        self.num_open_streams += 1
        client_gone = asyncio.ensure_future(reader.read(1))  # b"" = EOF: the client closed the connection
        is_complete = is_aborted = False
        try:
            for index, event in enumerate(_events(endpoint, request, behavior)):
                if index and behavior.inter_token_s:
                    await asyncio.wait((client_gone,), timeout=behavior.inter_token_s)
                if client_gone.done():
                    is_aborted = True
                    return False
                if event is None:  # the cut point of stream_cut
                    if behavior.cut_when is not None:
                        await _until_set(behavior.cut_when, client_gone, behavior.hold_s)
                        if client_gone.done():
                            is_aborted = True
                            return False
                    writer.transport.abort()
                    return False
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            is_complete = True
            return True
        except ConnectionError:
            is_aborted = True
            return False
        finally:
            self.num_open_streams -= 1
            self.num_streams_completed += int(is_complete)
            self.num_streams_aborted += int(is_aborted)
            client_gone.cancel()
            with contextlib.suppress(BaseException):
                await client_gone  # let the reader settle before it reads the next request

    async def _hold(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        behavior: Behavior,
        request: dict[str, Any],
        endpoint: str,
    ) -> None:
        """The hold modes: keep the connection busy without finishing, until the client goes away."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + behavior.hold_s
        client_gone = asyncio.ensure_future(reader.read(1))  # b"" = EOF: the client closed the connection
        is_stream = behavior.mode != "hang"
        is_gone = False
        if is_stream:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            self.num_open_streams += 1
        try:
            if is_stream:
                for event in _events(endpoint, request, behavior)[: behavior.cut_after]:
                    _write_chunk(writer, event or b"")
            if behavior.mode == "sse_huge":
                _write_chunk(writer, b"data: " + b"x" * behavior.size)
            while not client_gone.done() and loop.time() < deadline:
                if behavior.mode == "sse_comments":
                    _write_chunk(writer, b": keep-alive\n\n")
                await writer.drain()
                await asyncio.wait((client_gone,), timeout=min(behavior.inter_token_s or 0.05, behavior.hold_s))
            is_gone = client_gone.done()
        except ConnectionError:
            is_gone = True
        finally:
            if is_stream:
                self.num_open_streams -= 1
                self.num_streams_aborted += int(is_gone)
            if is_gone:
                self.client_gone.set()
            client_gone.cancel()
            with contextlib.suppress(BaseException):
                await client_gone


async def _until_set(event: threading.Event, client_gone: asyncio.Future[bytes], timeout_s: float) -> None:
    """Wait until the test sets `event` (from its own thread, hence polled), the client goes away or `timeout_s`
    passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not event.is_set() and not client_gone.done() and loop.time() < deadline:
        await asyncio.wait((client_gone,), timeout=0.005)


def _write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def _write_huge(writer: asyncio.StreamWriter, behavior: Behavior, request: dict[str, Any]) -> None:
    body = orjson.dumps(_response("chat", request, Behavior(content="a" * behavior.size)))  # valid, only too big
    if behavior.variant == "gzip":
        _write(writer, 200, gzip.compress(body, compresslevel=9), extra_headers={"content-encoding": "gzip"})
    elif behavior.variant == "chunked":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        for start in range(0, len(body), 1 << 16):
            _write_chunk(writer, body[start : start + (1 << 16)])
        writer.write(b"0\r\n\r\n")
    else:
        _write(writer, 200, body)


def _endpoint(path: str) -> str:
    path = path.split("?", 1)[0]
    if path.endswith("/embeddings"):
        return "embeddings"
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        return "completions"
    return "chat"


def _write(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    extra_headers: dict[str, str] | None = None,
) -> None:
    lines = [f"HTTP/1.1 {status} X", f"content-type: {content_type}", f"content-length: {len(body)}"]
    lines.extend(f"{k}: {v}" for k, v in (extra_headers or {}).items())
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)


def _usage(behavior: Behavior) -> dict[str, Any]:
    if behavior.usage is not None:
        return behavior.usage
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": behavior.num_chunks,
        "total_tokens": PROMPT_TOKENS + behavior.num_chunks,
    }


def _response(endpoint: str, request: dict[str, Any], behavior: Behavior) -> dict[str, Any]:
    model = request.get("model", "fake")
    if endpoint == "embeddings":
        inputs = request.get("input")
        count = len(inputs) if isinstance(inputs, list) else 1
        data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i in range(count)]
        usage = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS}
        return {"object": "list", "data": data, "model": model, "usage": usage}
    if endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": behavior.content, "finish_reason": "stop", "logprobs": None}
        kind = "text_completion"
    else:
        message = {"role": "assistant", "content": behavior.content}
        choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
        kind = "chat.completion"
    return {
        "id": "fake-1",
        "object": kind,
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": _usage(behavior),
    }


def _chunk(endpoint: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    kind = "text_completion" if endpoint == "completions" else "chat.completion.chunk"
    chunk = {"id": "fake-1", "object": kind, "created": 0, "model": model, "choices": choices, **extra}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _events(endpoint: str, request: dict[str, Any], behavior: Behavior) -> list[bytes | None]:
    model = request.get("model", "fake")
    is_chat = endpoint != "completions"
    events: list[bytes | None] = []
    if is_chat:
        events.append(_chunk(endpoint, model, [{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
    for i in range(behavior.num_chunks):
        piece = {"index": 0, "delta": {"content": f"t{i} "}} if is_chat else {"index": 0, "text": f"t{i} "}
        events.append(_chunk(endpoint, model, [{**piece, "finish_reason": None}]))
    finish = {"index": 0, "delta": {}} if is_chat else {"index": 0, "text": ""}
    events.append(_chunk(endpoint, model, [{**finish, "finish_reason": "stop"}]))
    options = request.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        events.append(_chunk(endpoint, model, [], usage=_usage(behavior)))
    events.append(b"data: [DONE]\n\n")
    if behavior.mode == "stream_cut":
        return [*events[: behavior.cut_after], None]
    if behavior.mode == "malformed_chunk":
        broken = {
            "not_json": b"data: {not json\n\n",
            "no_delta": _chunk(endpoint, model, [{"index": 0}]),
            "choices_not_list": _chunk(endpoint, model, {"index": 0}),  # type: ignore[arg-type]
        }[behavior.variant or "not_json"]
        return [*events[: behavior.cut_after], broken, b"data: [DONE]\n\n"]
    if behavior.mode == "error_chunk":
        text = behavior.message or "overloaded mid-stream"
        error = b"data: " + orjson.dumps({"error": {"message": text, "type": "server_error"}}) + b"\n\n"
        return [*events[: behavior.cut_after], error]
    return events


def _malformed_body(variant: str, request: dict[str, Any]) -> bytes:
    good = _response("chat", request, Behavior())
    body: Any = copy.deepcopy(good)
    choice = body["choices"][0]
    if variant == "not_json":
        return b"upstream says: everything is fine"
    if variant == "no_choices":
        del body["choices"]
    elif variant == "empty_choices":
        body["choices"] = []
    elif variant == "choices_not_list":
        body["choices"] = choice
    elif variant == "choice_not_object":
        body["choices"] = ["hello"]
    elif variant == "no_message":
        del choice["message"]
    elif variant == "wrong_types":
        choice["message"]["content"] = 42
    elif variant == "array_body":
        body = [good]
    elif variant == "missing_index":
        del choice["index"]
    elif variant == "missing_finish_reason":
        del choice["finish_reason"]
    elif variant == "tool_call_types":
        choice["message"]["tool_calls"] = [{"id": 5, "function": 7}]
    elif variant in ("tool_calls_no_content", "tool_calls_arguments_object"):
        del choice["message"]["content"]
        arguments: Any = {"city": "Paris"} if variant == "tool_calls_arguments_object" else "{}"
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        choice["message"]["tool_calls"] = [call]
        choice["finish_reason"] = "tool_calls"
    else:
        raise ValueError(f"unknown malformed variant {variant!r}")
    return orjson.dumps(body)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the fake OpenAI-compatible upstream.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--uvloop", action="store_true", help="use uvloop (benchmarks)")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    upstream = FakeUpstream(host=args.host, port=args.port)
    upstream.is_recording = False
    upstream.start()
    print(f"fake upstream on {upstream.base_url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        upstream.stop()


if __name__ == "__main__":
    main()
