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
    assert config.engine.speculative.ngram_max == 3  # unset fields keep their defaults


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
        ({"type": "local", "speculative": {"method": "draft"}}, "speculative.method"),
        ({"type": "local", "speculative": {"num_tokens": 0}}, "speculative.num_tokens"),
        ({"type": "local", "speculative": {"ngram_min": 3, "ngram_max": 2}}, "ngram_min (3) must be <= ngram_max (2)"),
        ({"type": "local", "speculative": {"methd": "ngram"}}, "speculative.methd"),
    ],
)
def test_a_wrong_speculative_entry_is_a_routing_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RoutingConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        deployment(**fields)
