"""`gateway.deployments`: a routing-file entry becomes its backend's own config (per-deployment settings over the
engine settings), and a field that does not apply to the deployment's type is refused with what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.deployments import local_config
from gateway.routing_config import DeploymentConfig, RoutingConfigError, parse_routing
from gateway.settings import Settings


def deployment(**fields: Any) -> DeploymentConfig:
    routing = parse_routing({"models": [{"id": "m", "deployments": [fields]}]}, source="t")
    return routing.models[0].deployments[0]


def settings(tmp_path: Path, **engine: Any) -> Settings:
    return Settings(_env_file=None, data_dir=tmp_path, engine=engine)  # type: ignore[arg-type]


def test_a_local_deployment_speculates_as_its_routing_entry_says(tmp_path: Path) -> None:
    entry = deployment(type="local", speculative={"method": "ngram", "num_tokens": 3, "ngram_min": 1})
    config = local_config(entry, settings(tmp_path))
    assert config.engine.speculative.method == "ngram"
    assert (config.engine.speculative.num_tokens, config.engine.speculative.ngram_min) == (3, 1)
    assert config.engine.speculative.ngram_max == 16  # unset fields keep their defaults


def test_a_local_deployment_names_its_draft_model(tmp_path: Path) -> None:
    fields = {"method": "draft", "draft_model_path": "/models/draft", "draft_dtype": "bfloat16", "draft_num_layers": 8}
    config = local_config(deployment(type="local", speculative=fields), settings(tmp_path))
    speculative = config.engine.speculative
    assert (speculative.method, speculative.draft_model_path) == ("draft", "/models/draft")
    assert (speculative.draft_dtype, speculative.draft_num_layers) == ("bfloat16", 8)


def test_without_an_entry_the_engine_settings_decide(tmp_path: Path) -> None:
    engine = {"speculative": {"method": "ngram", "num_tokens": 6}, "block_size": 32}
    config = local_config(deployment(type="local"), settings(tmp_path, **engine))
    assert (config.engine.speculative.method, config.engine.speculative.num_tokens) == ("ngram", 6)
    assert config.engine.block_size == 32
    overridden = local_config(deployment(type="local", speculative={"method": "off"}), settings(tmp_path, **engine))
    assert overridden.engine.speculative.method == "off"
    assert overridden.engine.block_size == 32  # only the speculative part is the deployment's


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "speculative": {"method": "ngram"}},
            "`speculative` applies to `type: local` deployments only",
        ),
        ({"type": "local", "speculative": {"method": "medusa"}}, "speculative.method"),
        ({"type": "local", "speculative": {"method": "draft"}}, "make that copy cheaper with draft_dtype"),
        ({"type": "local", "speculative": {"draft_dtype": "int4"}}, "speculative.draft_dtype"),
        ({"type": "local", "speculative": {"num_tokens": 0}}, "speculative.num_tokens"),
        ({"type": "local", "speculative": {"ngram_min": 3, "ngram_max": 2}}, "ngram_min (3) must be <= ngram_max (2)"),
        ({"type": "local", "speculative": {"methd": "ngram"}}, "speculative.methd"),
    ],
)
def test_a_wrong_speculative_entry_is_a_routing_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RoutingConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        deployment(**fields)


def test_a_local_deployment_quantizes_as_its_routing_entry_says(tmp_path: Path) -> None:
    entry = deployment(type="local", quantization="int4", quantization_group_size=64)
    config = local_config(entry, settings(tmp_path, block_size=32))
    assert (config.engine.quantization, config.engine.quantization_group_size) == ("int4", 64)
    assert config.engine.block_size == 32  # only the quantization is the deployment's
    inherited = local_config(deployment(type="local"), settings(tmp_path, quantization="int8"))
    assert (inherited.engine.quantization, inherited.engine.quantization_group_size) == ("int8", 32)
    only_method = local_config(deployment(type="local", quantization="none"), settings(tmp_path, quantization="int8"))
    assert only_method.engine.quantization == "none"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "quantization": "int8"},
            "`quantization` applies to `type: local` deployments only",
        ),
        (
            {"type": "anthropic", "base_url": "http://127.0.0.1:9/v1", "quantization_group_size": 64},
            "`quantization_group_size` applies to `type: local` deployments only",
        ),
        ({"type": "local", "quantization": "int2"}, "quantization"),
        ({"type": "local", "quantization": "int4", "quantization_group_size": 48}, "quantization_group_size"),
        ({"type": "local", "quantization_group_size": 0}, "quantization_group_size"),
    ],
)
def test_a_wrong_quantization_entry_is_a_routing_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RoutingConfigError, match=message):
        deployment(**fields)


def test_sampling_defaults_come_from_the_entry_then_the_engine_settings(tmp_path: Path) -> None:
    assert (
        local_config(deployment(type="local"), settings(tmp_path)).engine.sampling_defaults is None
    )  # the model's own
    engine_wide = settings(tmp_path, sampling_defaults={"temperature": 0.7})
    assert local_config(deployment(type="local"), engine_wide).engine.sampling_defaults == {"temperature": 0.7}
    entry = deployment(type="local", sampling_defaults={"top_p": 0.9, "top_k": 40})
    assert local_config(entry, engine_wide).engine.sampling_defaults == {"top_p": 0.9, "top_k": 40}  # whole, not merged
    assert local_config(deployment(type="local", sampling_defaults={}), engine_wide).engine.sampling_defaults == {}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "sampling_defaults": {"temperature": 0.2}},
            "`sampling_defaults` applies to `type: local` deployments only",
        ),
        ({"type": "local", "sampling_defaults": {"seed": 1}}, "not seed"),
        ({"type": "local", "sampling_defaults": {"top_p": 2}}, "top_p must be a number in"),
        (
            {"type": "local", "sampling_defaults": {"temperature": "0.5"}},
            "temperature must be a finite number, got a string",
        ),
        (
            {"type": "local", "sampling_defaults": {"temperature": True}},
            "temperature must be a finite number, got True",
        ),
        ({"type": "local", "sampling_defaults": [0.5]}, "sampling_defaults"),
    ],
)
def test_a_wrong_sampling_defaults_entry_is_a_routing_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RoutingConfigError, match=message):
        deployment(**fields)


def test_a_wrong_engine_wide_sampling_default_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sampling defaults take temperature"):
        settings(tmp_path, sampling_defaults={"max_tokens": 5})
