"""Benchmarks: each writes ``result.json`` and ``result.md`` into its output folder."""
