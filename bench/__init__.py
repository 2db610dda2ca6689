"""Measurement tools: `unigate bench` (load generation, streaming latency figures, SLO search, compare) and
`unigate kv-plan` (KV-cache arithmetic). The commands are added to the CLI by `bench.cli.register`."""

__all__: list[str] = []
