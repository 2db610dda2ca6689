"""The ledger (gateway/ledger.py): what admission reserves, what a settle charges (`Settlement.of`, in every family's
names and when an answer reported no counts), and that it settles exactly once, whoever asks and how often."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from decimal import Decimal

import pytest
from fakes.access import RecordingAccess
from fakes.app import MASTER
from fakes.stages import ScriptedBackend, make_context, one_model_router

from auth.base import Admission, SettleUsage
from gateway.ledger import Ledger, Settlement, Usage
from gateway.routing_config import PricingConfig

PRICE = PricingConfig(input_per_mtok=Decimal(2), output_per_mtok=Decimal(10))


async def admitted(access: RecordingAccess | None = None, **body: object) -> Ledger:
    router = one_model_router(ScriptedBackend())
    context = make_context(router, access)
    request = {"messages": [{"role": "user", "content": "x" * 400}], **body}
    return await Ledger.admit(context, router.resolve("m"), endpoint="chat/completions", body=request)


async def test_admission_reserves_the_prompt_estimate_and_every_choices_output_limit() -> None:
    ledger = await admitted(max_tokens=50, n=3)
    assert ledger.num_prompt_tokens == 101  # 400 characters / 4, plus one
    assert ledger.admission.reserved_tokens == 101 + 3 * 50


def charged(usage: Usage, pricing: PricingConfig | None = None) -> tuple[int, int, bool]:
    settlement = Settlement.of(usage, num_prompt_estimate=50, pricing=pricing)
    return settlement.usage.prompt_tokens, settlement.usage.completion_tokens, settlement.is_estimated


@pytest.mark.parametrize(
    ("reported", "expected"),
    [
        ({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}, (10, 5, False)),
        ({"input_tokens": 10, "output_tokens": 7}, (10, 7, False)),  # Anthropic and Responses names
        ({"input_tokens": 10, "cache_read_input_tokens": 20, "cache_creation_input_tokens": 3}, (33, 0, False)),
        ({"prompt_tokens": -4, "completion_tokens": "7"}, (0, 0, False)),  # counts, if nonsense ones: clamped
    ],
    ids=["openai", "anthropic", "anthropic-cache", "nonsense"],
)
def test_reported_counts_are_charged_as_they_are(reported: dict[str, object], expected: tuple[int, int, bool]) -> None:
    assert charged(Usage(reported, num_completion_chars=999, has_run=True)) == expected


@pytest.mark.parametrize(
    ("reported", "expected"),
    [
        (None, (50, 3, True)),  # the admission's prompt estimate; 9 characters → 3 tokens (rounded up)
        ({"total_tokens": 30}, (30, 0, True)),  # a total alone is split prompt-first
        ({"total_tokens": 80}, (50, 30, True)),
    ],
)
def test_an_answer_without_counts_is_charged_an_estimate(
    reported: dict[str, object] | None, expected: tuple[int, int, bool]
) -> None:
    assert charged(Usage(reported, num_completion_chars=9, has_run=True)) == expected


def test_nothing_is_charged_for_what_never_ran_but_the_price_is_known() -> None:
    settlement = Settlement.of(Usage(), num_prompt_estimate=50, pricing=PRICE)
    assert settlement.usage == SettleUsage(prompt_tokens=0, completion_tokens=0, cost_micros=0, is_priced=True)
    assert not settlement.is_estimated


def test_the_charge_is_priced() -> None:
    settlement = Settlement.of(
        Usage({"prompt_tokens": 1000, "completion_tokens": 100}), num_prompt_estimate=1, pricing=PRICE
    )
    assert settlement.usage.cost_micros == 1000 * 2 + 100 * 10 and settlement.usage.is_priced


def test_an_answers_usage_and_its_text() -> None:
    answer = {"choices": [{"message": {"content": "twelve chars"}}], "usage": {"total_tokens": 3}}
    assert Usage.of_answer(answer) == Usage({"total_tokens": 3}, num_completion_chars=12, has_run=True)
    counted = {"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    assert Usage.of_answer(counted).num_completion_chars == 0  # counts came: the text is not needed


async def test_it_settles_exactly_once_with_the_first_usage() -> None:
    access = RecordingAccess(master_key=MASTER)  # raises on a second settle of one admission
    ledger = await admitted(access)
    ledger.begin_settle(Usage({"prompt_tokens": 1, "completion_tokens": 2}), None)
    ledger.begin_settle(Usage({"prompt_tokens": 9, "completion_tokens": 9}), PRICE)
    await ledger.settle(Usage({"prompt_tokens": 9, "completion_tokens": 9}), PRICE)
    await ledger.settle(Usage(), None)
    assert [(s.prompt_tokens, s.completion_tokens, s.is_priced) for s in access.settled] == [(1, 2, False)]
    assert ledger.settlement is not None and ledger.settlement.usage.prompt_tokens == 1


class FailingSettle(RecordingAccess):
    def begin_settle(self, admission: Admission, usage: SettleUsage) -> Awaitable[None]:
        super().begin_settle(admission, usage)

        async def fail() -> None:
            raise ConnectionError("redis went away")

        return fail()


async def test_a_failed_settle_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    ledger = await admitted(FailingSettle(master_key=MASTER))
    with caplog.at_level(logging.ERROR, logger="unigate.pipeline"):
        await ledger.settle(Usage({"prompt_tokens": 1, "completion_tokens": 2}), None)
    assert [r.getMessage() for r in caplog.records] == ["could not settle usage for request req-1"]
