"""The admin API's team and key bodies, fuzzed from their fields: a body is either refused with a 400 that names a
field, or its fields are ones the store accepts (`auth.teams` re-checks every caller's values)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from auth.admin import KeyCreateBody, KeyUpdateBody, TeamCreateBody, TeamUpdateBody, parse_body
from auth.teams import _check
from gateway.errors import InvalidRequestError

_FIELDS = [
    "name",
    "models",
    "rpm",
    "tpm",
    "max_concurrent",
    "token_budget",
    "budget_usd",
    "budget_period",
    "weight",
    "priority",
    "metadata",
    "team_id",
    "expires_at",
    "unknown",
]
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["total", "month", "week", "high", "low", "1.5", "0.0000001", "team_0123456789abcdef", "a\nb"]),
    st.lists(st.text(max_size=6), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_BODIES = st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=6)


def _parsed(body: dict[str, Any], model: Any) -> dict[str, Any] | None:
    try:
        return dict(parse_body(json.dumps(body).encode(), model).record_fields())
    except InvalidRequestError as error:
        assert error.status_code == 400 and error.param, body
        return None


@settings(max_examples=300, deadline=None)
@given(_BODIES)
def test_a_team_body_the_api_takes_is_one_the_store_takes(body: dict[str, Any]) -> None:
    for model in (TeamCreateBody, TeamUpdateBody):
        fields = _parsed({"name": "t", **body} if model is TeamCreateBody else body, model)
        if fields is not None:
            _check(fields)  # raises on a value the store would refuse


@settings(max_examples=300, deadline=None)
@given(_BODIES)
def test_key_bodies_keep_weight_priority_and_team_id_in_range(body: dict[str, Any]) -> None:
    for model in (KeyCreateBody, KeyUpdateBody):
        fields = _parsed(body, model)
        if fields is None:
            continue
        weight = fields.get("weight", 1.0)
        assert isinstance(weight, float) and 0 < weight <= 1_000_000
        assert fields.get("priority", "normal") in ("high", "normal", "low")
        team_id = fields.get("team_id")
        assert team_id is None or (team_id.startswith("team_") and len(team_id) == 21)
