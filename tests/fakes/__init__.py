"""Fakes shared by test folders: misbehaving OpenAI-compatible and Anthropic upstreams, a threaded uvicorn runner,
and stream building blocks (`fakes.streams`).

`tests/` is on sys.path during pytest (tests/conftest.py is a rootdir conftest), so import them as
`from fakes.upstream import FakeUpstream` and reuse the fixtures with, in your folder's conftest.py,
`from fakes.fixtures import fake_upstream, gateway_server  # noqa: F401`.
"""
