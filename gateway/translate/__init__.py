"""Translation between API families: Anthropic Messages ⇄ chat completions ⇄ OpenAI Responses.

Pure functions over dicts, no I/O: requests one way, responses and streams the other. Chat completions is the
common language: every backend serves it (natively or, for `type: anthropic`, through the backend's own
translation, `backends.anthropic_translate`).
"""

from __future__ import annotations

from gateway.translate.anthropic import chat_chunks_to_events, chat_to_message, messages_to_chat
from gateway.translate.responses import chat_chunks_to_response_events, chat_to_response, responses_to_chat
from gateway.translate.sse import with_keepalive

__all__ = [
    "chat_chunks_to_events",
    "chat_chunks_to_response_events",
    "chat_to_message",
    "chat_to_response",
    "messages_to_chat",
    "responses_to_chat",
    "with_keepalive",
]
