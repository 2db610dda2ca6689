"""A stream's accounting (gateway/stream_accounting.py): the usage its chunks report, merged; the text generated (the
estimate for a stream cut before its usage); the usage chunk stripped unless the client asked; every chunk named
with the model that served."""

from __future__ import annotations

from typing import Any

from gateway.ledger import Usage
from gateway.stream_accounting import StreamAccount

CHAT: dict[str, Any] = {"messages": []}
USAGE_CHUNK = {"model": "up-name", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}


def delta(text: str) -> dict[str, Any]:
    return {"model": "up-name", "choices": [{"index": 0, "delta": {"content": text}}]}


def test_a_stream_nothing_was_taken_from_has_not_run() -> None:
    assert StreamAccount("chat/completions", CHAT, served_model="m").usage() == Usage()


def test_usage_is_taken_and_its_chunk_stripped_when_the_client_did_not_ask() -> None:
    account = StreamAccount("chat/completions", CHAT, served_model="m")
    assert account.accept(delta("Hello")) == {**delta("Hello"), "model": "m"}
    assert account.accept(dict(USAGE_CHUNK)) is None
    assert account.usage() == Usage({"prompt_tokens": 4, "completion_tokens": 2}, num_completion_chars=5, has_run=True)


def test_the_usage_chunk_is_kept_when_the_client_asked() -> None:
    body = {**CHAT, "stream_options": {"include_usage": True}}
    account = StreamAccount("chat/completions", body, served_model="m")
    assert account.accept(dict(USAGE_CHUNK)) == {**USAGE_CHUNK, "model": "m"}


def test_usage_on_a_chunk_with_choices_is_taken_off_that_chunk_only() -> None:
    account = StreamAccount("completions", {}, served_model="m")
    chunk = {"choices": [{"index": 0, "text": "abc"}], "usage": {"completion_tokens": 1}}
    assert account.accept(chunk) == {"choices": [{"index": 0, "text": "abc"}]}
    assert account.usage() == Usage({"completion_tokens": 1}, num_completion_chars=3, has_run=True)


def test_anthropic_events_pass_untouched_and_their_usage_is_merged() -> None:
    account = StreamAccount("messages", {}, served_model="m")
    start = {
        "type": "message_start",
        "message": {"model": "up-name", "usage": {"input_tokens": 11, "output_tokens": 1}},
    }
    end = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}}
    assert account.accept(start) is start and start["message"]["model"] == "m"
    assert account.accept(end) == end  # not an OpenAI stream: its usage stays
    assert account.usage().reported == {"input_tokens": 11, "output_tokens": 5}


# -- a stream whose backend counts what it used (the local engine: `OpenStream.usage_so_far`) ---------------------

ENGINE_COUNTS = {"prompt_tokens": 4519, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4512}}


def test_a_cut_stream_is_charged_its_backends_own_counts_exactly() -> None:
    from gateway.ledger import Settlement

    account = StreamAccount("chat/completions", CHAT, served_model="m", metered=lambda: ENGINE_COUNTS)
    account.accept(delta("漢字"))  # the client leaves after this chunk: no finish reason, no usage chunk
    usage = account.usage()
    assert usage.is_cut and usage.reported == ENGINE_COUNTS
    settled = Settlement.of(usage, num_prompt_estimate=376, pricing=None, num_prompt_bound=4520).usage
    assert (settled.prompt_tokens, settled.completion_tokens, settled.is_estimated) == (4519, 3, False)


def test_a_backend_without_counts_leaves_a_cut_stream_to_the_estimate() -> None:
    account = StreamAccount("chat/completions", CHAT, served_model="m", metered=lambda: None)
    account.accept(delta("abc"))
    assert account.usage() == Usage(None, num_completion_chars=3, has_run=True, is_cut=True)


def test_the_streams_own_usage_chunk_wins_over_the_meter() -> None:
    account = StreamAccount("chat/completions", CHAT, served_model="m", metered=lambda: ENGINE_COUNTS)
    account.accept(delta("Hello"))
    account.accept(dict(USAGE_CHUNK))
    assert account.usage().reported == {"prompt_tokens": 4, "completion_tokens": 2}
    unstarted = StreamAccount("chat/completions", CHAT, served_model="m", metered=lambda: ENGINE_COUNTS)
    assert unstarted.usage() == Usage()  # nothing reached the client: nothing is charged from here
