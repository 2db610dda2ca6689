"""Output limits that fit the context: a too-big `max_tokens` lowered rather than refused, and what admission reserves.

A request whose prompt fits a deployment's context but whose output limit does not is served with the limit lowered
to the room left, when the deployment clamps (`clamp_max_tokens` in the routing file; docs/coding-agents.md):

- the local engine counts the prompt exactly and lowers the limit itself (`backends.local`); its first response or
  chunk reports `[requested, served]` under `backends.base.MAX_TOKENS_CLAMPED_KEY`, which `take_backend_clamp` removes;
- for an upstream with `context_length` in the routing file, `clamp_for_upstream` lowers the limit in the body sent,
  from an estimate of the prompt on the safe side (`CLAMP_BYTES_PER_TOKEN` bytes of the request's JSON per token,
  tools included), and leaves the request alone when even the estimate does not fit: the upstream then decides.

Either way the response carries `x-unigate-max-tokens-clamped: <requested> -> <served>` (`CLAMP_HEADER`) and a debug
line is logged. A prompt that does not fit at all stays a 400 `context_length_exceeded`.

Admission (`reserved_output_tokens`) reserves the request's output limit, or the default it gets when it sets none
(legacy completions: 16, OpenAI's default, which the local engine and vLLM keep too; otherwise the deployments'
default), capped at the room its estimated prompt leaves when every deployment of the model clamps and knows its
context: about what the call can really use. The settle trues it up to the usage reported.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import orjson

from backends.base import MAX_TOKENS_CLAMPED_KEY, Endpoint, FitsOutput, Json, OutputLimits
from gateway.router import Deployment

__all__ = [
    "CLAMP_BYTES_PER_TOKEN",
    "CLAMP_HEADER",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "clamp_for_upstream",
    "clamp_header_value",
    "deployment_limits",
    "requested_max_tokens",
    "reserved_output_tokens",
    "take_backend_clamp",
]

logger = logging.getLogger("unigate.pipeline")

CLAMP_HEADER = "x-unigate-max-tokens-clamped"
# Upstream prompts are estimated at this many bytes of JSON per token: fewer than any common tokenizer averages on
# English, code or JSON schemas, so the estimate errs high and the lowered limit still fits.
CLAMP_BYTES_PER_TOKEN = 3
# The output limit of a legacy completions request without `max_tokens` (or with null): OpenAI's, vLLM's and the
# local engine's (`local_engine.sampling_params`), whatever a deployment's `default_max_tokens` says.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The output-limit fields of chat completions (either), legacy completions and Anthropic Messages, and Responses.
_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def requested_max_tokens(body: Json) -> tuple[str, int] | None:
    """(field, value) of the request's output limit, None when it sets none."""
    for name in _FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


_FITS_OUTPUT: dict[type, bool] = {}


def _fits_output(backend: object) -> bool:
    """`isinstance(backend, FitsOutput)`, remembered per backend class: a runtime-checkable protocol's isinstance
    costs microseconds, and this runs on every request."""
    kind = type(backend)
    known = _FITS_OUTPUT.get(kind)
    if known is None:
        known = _FITS_OUTPUT[kind] = isinstance(backend, FitsOutput)
    return known


def deployment_limits(deployment: Deployment) -> OutputLimits:
    """The local engine says its own (`FitsOutput`); an upstream's come from the routing file."""
    backend = deployment.backend
    if _fits_output(backend):
        return cast(FitsOutput, backend).output_limits()
    config = deployment.config
    is_clamping = config.clamps_max_tokens and config.context_length is not None
    return OutputLimits(config.context_length, is_clamping, None)


def reserved_output_tokens(
    deployments: Sequence[Deployment], endpoint: Endpoint, body: Json, *, num_prompt_tokens: int, fallback: int
) -> int:
    """The output tokens admission reserves for one choice of `endpoint` (see the module docstring); `fallback` when
    the request sets no limit and not every deployment has a default."""
    limits = [deployment_limits(d) for d in deployments]
    found = requested_max_tokens(body)
    if found is not None and found[1] > 0:
        num_tokens = found[1]
    elif endpoint == "completions":
        num_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        defaults = [limit.default_max_tokens for limit in limits if limit.default_max_tokens is not None]
        num_tokens = max(defaults) if defaults and len(defaults) == len(limits) else fallback
    contexts = [limit.context_length for limit in limits if limit.is_clamping and limit.context_length is not None]
    if contexts and len(contexts) == len(limits):
        num_tokens = min(num_tokens, max(max(contexts) - num_prompt_tokens, 1))
    return num_tokens


def clamp_for_upstream(deployment: Deployment, body: Json) -> tuple[int, int] | None:
    """Lower the output limit in `body` (the copy sent to an upstream) to the room its estimated prompt leaves in
    the configured `context_length`; returns `(requested, served)` when it did."""
    config = deployment.config
    if config.context_length is None or not config.clamps_max_tokens or _fits_output(deployment.backend):
        return None
    found = requested_max_tokens(body)
    if found is None:
        return None
    name, requested = found
    num_prompt_tokens = _estimate_prompt_tokens(body)
    if num_prompt_tokens is None:
        return None
    room = config.context_length - num_prompt_tokens
    if room < 1 or requested <= room:
        return None
    body[name] = room
    logger.debug(
        "max_tokens clamped %d -> %d for %s: the prompt has about %d tokens (estimated) of its %d",
        requested,
        room,
        deployment.name,
        num_prompt_tokens,
        config.context_length,
    )
    return requested, room


def take_backend_clamp(data: Json) -> tuple[int, int] | None:
    """Remove a backend's clamp report from its response or first chunk; `(requested, served)` when there was one."""
    value: Any = data.pop(MAX_TOKENS_CLAMPED_KEY, None)
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return value[0], value[1]
    return None


def clamp_header_value(clamped: tuple[int, int]) -> str:
    requested, served = clamped
    return f"{requested} -> {served}"


def _estimate_prompt_tokens(body: Json) -> int | None:
    """On the high side: every byte of the request's JSON counts (sampling fields included; they are a few dozen).
    None for a body nested deeper than orjson writes (the backend refuses it anyway)."""
    try:
        return len(orjson.dumps(body)) // CLAMP_BYTES_PER_TOKEN + 1
    except orjson.JSONEncodeError:
        return None
