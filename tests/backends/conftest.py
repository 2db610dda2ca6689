"""The local backend's tests use the engine's session fixtures (a tiny random model, the bundled tokenizer)."""

from fakes.engine_models import bundled_checkpoint, real_tokenizer, tiny_model_dir  # noqa: F401
