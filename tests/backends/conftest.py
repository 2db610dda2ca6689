"""The local backend's tests use the engine's session fixtures (a tiny random model, the bundled tokenizer), defined
for the whole suite in tests/conftest.py."""
