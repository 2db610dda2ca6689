"""A stream's accounting as its chunks pass to the client: `StreamAccount`.

Each chunk is named with the model that served; the usage it reports is merged (OpenAI-family streams report it in a
last chunk, Anthropic events their input tokens first); the generated text is counted, which is what the ledger
charges (as an estimate) when the stream reports no usage. A stream cut before its end (no finish reason, usage chunk
or terminal event) is `Usage.is_cut`: its prompt is charged the bound that never undercounts (gateway/estimates.py),
unless its backend counted what it used (`metered`: the local engine's own counts, read once the stream is closed),
which is then charged exactly.
The pipeline always asks OpenAI-family upstreams for usage; a client that did not ask gets those usage chunks
stripped. Other families pass untouched."""

from __future__ import annotations

from collections.abc import Callable

from backends.base import Endpoint, Json
from gateway.estimates import has_counts
from gateway.ledger import Usage
from gateway.normalize import name_model

__all__ = ["USAGE_ENDPOINTS", "StreamAccount"]

USAGE_ENDPOINTS = ("chat/completions", "completions")  # their streams report usage only when asked to
# The last events of Anthropic Messages and Responses streams.
_TERMINAL_EVENTS = frozenset({"message_delta", "message_stop", "response.completed", "response.incomplete"})


class StreamAccount:
    def __init__(
        self, endpoint: Endpoint, body: Json, *, served_model: str, metered: Callable[[], Json | None] | None = None
    ) -> None:
        self._served_model = served_model
        self._metered = metered  # the backend's own count so far (`OpenStream.usage_so_far`), if it keeps one
        self._strips_usage = endpoint in USAGE_ENDPOINTS and not _wants_usage(body)
        self._reported: Json | None = None
        self._num_completion_chars = 0
        self._has_started = False  # the first chunk went on its way to the client
        self._has_ended = False  # a finish reason or a terminal event came: the stream was not cut

    def accept(self, chunk: Json) -> Json | None:
        """The chunk to send (None: nothing to send), after taking its usage and completion size."""
        self._has_started = True
        name_model(chunk, self._served_model)
        if "usage" in chunk:
            usage = chunk["usage"]
            if isinstance(usage, dict):
                self._reported = {**(self._reported or {}), **usage}
                self._has_ended = True  # the usage chunk: the last an OpenAI-family stream sends
            if self._strips_usage:
                if not chunk.get("choices"):
                    return None
                del chunk["usage"]
        elif chunk.get("type") == "message_start":  # Anthropic events: input tokens arrive first
            message = chunk.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self._reported = {**(self._reported or {}), **usage}
        if chunk.get("type") in _TERMINAL_EVENTS:
            self._has_ended = True
        for choice in chunk.get("choices", ()):
            if choice.get("finish_reason") is not None:
                self._has_ended = True
            delta = choice.get("delta") or choice
            text = delta.get("content") if isinstance(delta, dict) else None
            if text is None and isinstance(delta, dict):
                text = delta.get("text")
            if isinstance(text, str):
                self._num_completion_chars += len(text)
        return chunk

    def usage(self) -> Usage:
        """What the stream used so far (all of it, once it ended)."""
        is_cut = self._has_started and not self._has_ended
        reported = self._reported
        if self._has_started and not has_counts(reported) and self._metered is not None:
            counted = self._metered()  # (a usage chunk the client left before: the same counts, up to the cut)
            if counted is not None:
                reported = {**(reported or {}), **counted}
        return Usage(reported, self._num_completion_chars, has_run=self._has_started, is_cut=is_cut)


def _wants_usage(body: Json) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True
