"""What a `type: local` deployment may set for its model is declared once (`backends.config.LocalModelOptions`, whose
quantization and speculative fields are the engine's `ModelOptions`; the gateway's `LocalModelSettings` extends it)
and merged in one function (`gateway.deployments.local_model_settings`): the entry's value where it sets one, the
engine setting's otherwise. The backends take the merged options whole and declare none of the fields again."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from backends.config import LocalEngineOptions, LocalModelOptions
from backends.engine_client import EngineClientConfig
from backends.local import LocalBackendConfig
from gateway.deployments import engine_client_config, local_config, local_model_settings
from gateway.routing_config import DeploymentConfig, parse_routing
from gateway.settings import EngineSettings, LocalModelSettings, Settings
from local_engine.config import EngineConfig, ModelOptions

# Per shared field: (an engine setting, a deployment's own value), each unlike the field's default and each other.
VALUES: dict[str, tuple[Any, Any]] = {
    "quantization": ("int8", "int4"),
    "quantization_group_size": (64, 128),
    "speculative": ({"method": "ngram", "num_tokens": 6}, {"method": "ngram", "num_tokens": 3, "ngram_min": 1}),
    "model_path": ("/models/engine-wide", "/models/own"),
    "default_max_tokens": (2048, 0),
    "sampling_defaults": ({"temperature": 0.7}, {"top_p": 0.9}),
}


def deployment(**fields: Any) -> DeploymentConfig:
    return parse_routing({"models": [{"id": "m", "deployments": [fields]}]}, source="t").models[0].deployments[0]


def settings(tmp_path: Path, **engine: Any) -> Settings:
    return Settings(_env_file=None, data_dir=tmp_path, engine=engine)  # type: ignore[arg-type]


def declaring_classes(model: type[BaseModel], field: str) -> list[type]:
    """Every class in `model`'s MRO whose own body declares `field`."""
    return [cls for cls in model.__mro__ if field in inspect.get_annotations(cls)]


def as_field(name: str, value: Any) -> Any:
    """`value` as the field holds it once validated."""
    return getattr(LocalModelSettings(**{name: value}), name)


def test_the_table_covers_every_shared_field() -> None:
    assert set(VALUES) == set(LocalModelSettings.model_fields) == set(LocalModelOptions.model_fields)
    assert set(ModelOptions.model_fields) < set(LocalModelSettings.model_fields)


@pytest.mark.parametrize("field", sorted(LocalModelSettings.model_fields))
@pytest.mark.parametrize("model", [EngineSettings, DeploymentConfig, LocalModelSettings, LocalEngineOptions])
def test_each_shared_field_is_declared_once(model: type[BaseModel], field: str) -> None:
    expected = ModelOptions if field in ModelOptions.model_fields else LocalModelOptions
    assert declaring_classes(model, field) == [expected]


def test_the_engine_options_are_declared_once() -> None:
    for field in [*EngineConfig.model_fields, *LocalEngineOptions.model_fields]:
        assert len(declaring_classes(EngineSettings, field)) == 1, field
    assert declaring_classes(EngineSettings, "load_wait_s") == [LocalEngineOptions]


@pytest.mark.parametrize("config", [LocalBackendConfig, EngineClientConfig])
def test_the_backend_configs_declare_none_of_the_model_fields(config: type) -> None:
    """They hold the merged options whole (`LocalBackendConfig.engine`, `EngineClientConfig.model`)."""
    declared_again = set(inspect.get_annotations(config)) & set(LocalEngineOptions.model_fields)
    assert not declared_again, sorted(declared_again)


@pytest.mark.parametrize("field", sorted(VALUES))
def test_the_deployment_value_wins_else_the_setting(tmp_path: Path, field: str) -> None:
    engine_wide, own = VALUES[field]
    configured = settings(tmp_path, **{field: engine_wide})
    assert getattr(local_model_settings(deployment(type="local"), configured), field) == as_field(field, engine_wide)
    entry = deployment(type="local", **{field: own})
    assert getattr(local_model_settings(entry, configured), field) == as_field(field, own)
    assert getattr(local_model_settings(entry, settings(tmp_path)), field) == as_field(field, own)
    null = deployment(type="local", **{field: None})  # null: as if left out
    assert getattr(local_model_settings(null, configured), field) == as_field(field, engine_wide)


def test_only_the_set_fields_are_the_deployments(tmp_path: Path) -> None:
    configured = settings(tmp_path, block_size=32, load_wait_s=5, default_max_tokens=2048, quantization="int8")
    merged = local_model_settings(deployment(type="local", default_max_tokens=64), configured)
    assert (merged.default_max_tokens, merged.quantization) == (64, "int8")
    assert (merged.block_size, merged.load_wait_s) == (32, 5)
    assert local_model_settings(deployment(type="local"), configured) == configured.engine


def test_the_engine_process_sees_the_same_overrides(tmp_path: Path) -> None:
    """The engine process (`--workers N`) gets the deployment as a JSON dump and validates it again."""
    configured = settings(tmp_path, default_max_tokens=2048, quantization="int8")
    entry = deployment(type="local", quantization="int4", sampling_defaults={"top_k": 40})
    again = DeploymentConfig.model_validate(entry.model_dump(mode="json"))
    assert (
        again.local_overrides()
        == entry.local_overrides()
        == {"quantization": "int4", "sampling_defaults": {"top_k": 40}}
    )
    assert local_model_settings(again, configured) == local_model_settings(entry, configured)


def test_both_backends_take_the_merged_values(tmp_path: Path) -> None:
    configured = settings(tmp_path, default_max_tokens=2048, load_wait_s=7, sampling_defaults={"temperature": 0.5})
    entry = deployment(type="local", default_max_tokens=300, model_path="/models/own", quantization="int8")
    config = local_config(entry, configured)
    assert type(config.engine) is LocalEngineOptions
    assert config.engine == LocalEngineOptions.of(local_model_settings(entry, configured))
    engine = config.engine
    assert (engine.default_max_tokens, engine.load_wait_s, engine.model_path) == (300, 7, "/models/own")
    assert engine.sampling_defaults == {"temperature": 0.5} and engine.quantization == "int8"
    client = engine_client_config(entry, configured.with_engine_sockets({entry.name: str(tmp_path / "e.sock")}))
    assert type(client.model) is LocalModelOptions
    assert client.model == LocalModelOptions.of(engine)
