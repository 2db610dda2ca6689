"""The span sender process (gateway/otlp_sender.py) against a real OTLP/HTTP receiver: what the gateway hands it
arrives, a stop delivers everything handed over, and a sender that dies is replaced without the gateway noticing
more than the batch it was writing."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from fakes.otlp import OtlpReceiver

from gateway.otlp_encoding import SpanRow
from gateway.otlp_sender import SenderProcess, pickle_trace, unpickle_batch


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def batch(name: str) -> bytes:
    """One trace of one span, as the gateway's export thread hands it over."""
    row: SpanRow = (name, 7, 0, 2, 1_000, 2_000, (("unigate.cost_usd", Decimal("0.25")),), "", False)
    return pickle_trace((42, "", [row]))


def names(receiver: OtlpReceiver) -> list[str]:
    return [span.name for span in receiver.spans()]


def test_batches_arrive_in_order_and_a_stop_delivers_all_of_them(receiver: OtlpReceiver) -> None:
    sender = SenderProcess({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    assert sender.pid is None  # started by the first batch, not before
    for n in range(20):
        assert sender.send(batch(f"s{n}"))
    sender.close()
    assert names(receiver) == [f"s{n}" for n in range(20)]
    assert sender.pid is None


def test_the_child_reads_the_exporters_and_the_resources_variables(receiver: OtlpReceiver) -> None:
    # A traces-specific endpoint is taken as given (no /v1/traces appended), as the SDK reads it.
    sender = SenderProcess(
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.url}/v1/traces",
            "OTEL_SERVICE_NAME": "sender-under-test",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
        }
    )
    assert sender.send(batch("direct"))
    sender.close()
    assert names(receiver) == ["direct"]
    assert receiver.service_names() == {"sender-under-test"}
    (request,) = receiver.requests()
    resource = {a.key: a.value.string_value for a in request.resource_spans[0].resource.attributes}
    assert resource["deployment.environment"] == "test"
    (span,) = receiver.spans()
    assert span.trace_id == (42).to_bytes(16, "big") and span.end_time_unix_nano == 2_000


def _wait_until_dead(pid: int) -> None:
    """Until the process has exited (a zombie, not yet reaped by its parent: the sender reaps it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not exit")


def _killed_sender(receiver: OtlpReceiver, restart_after_s: float) -> tuple[SenderProcess, int]:
    """A sender whose child took one batch ("first") and was then killed; the dead child's pid."""
    sender = SenderProcess({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}, restart_after_s=restart_after_s)
    assert sender.send(batch("first"))
    first = sender.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    _wait_until_dead(first)
    return sender, first


def test_a_sender_that_dies_is_replaced_with_the_next_batch(receiver: OtlpReceiver) -> None:
    sender, first = _killed_sender(receiver, restart_after_s=0)
    assert sender.send(batch("second")) and sender.send(batch("third"))
    assert sender.pid not in (None, first)
    sender.close()
    assert names(receiver)[-2:] == ["second", "third"]  # "first" only if the child read it before it was killed


def test_a_dead_sender_is_restarted_at_most_once_per_interval(receiver: OtlpReceiver) -> None:
    """A child that keeps dying must not be started for every batch: within `restart_after_s` of the last start a
    batch is reported unsent (False) and counted as such, not sent."""
    sender, _ = _killed_sender(receiver, restart_after_s=60)
    assert not sender.send(batch("lost"))  # no new child within a minute of the last start
    sender.close()
    assert "lost" not in names(receiver)


def test_an_interrupt_to_the_process_group_does_not_cut_the_sender(receiver: OtlpReceiver) -> None:
    """Ctrl-C reaches the gateway's whole process group; the sender must still send what the gateway's stop then
    hands it, and end only when its input closes."""
    sender = SenderProcess({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    assert sender.send(batch("one"))
    pid = sender.pid
    assert pid is not None
    deadline = time.monotonic() + 30
    while not names(receiver) and time.monotonic() < deadline:  # running main() (it ignores the signals from there)
        time.sleep(0.02)
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    assert sender.send(batch("two")) and sender.pid == pid
    sender.close()
    assert names(receiver) == ["one", "two"]


def test_a_frame_is_its_traces_pickled_one_after_another() -> None:
    traces = [(n, "k=v" if n % 2 else "", [(f"s{n}", n, 0, 1, 1, 2, (("a", n),), "", False)]) for n in range(1, 4)]
    assert unpickle_batch(b"".join(pickle_trace(t) for t in traces)) == traces
    assert unpickle_batch(b"") == []
