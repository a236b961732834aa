"""Benchmarks of a serving pair: prefill and decode speed, before/after comparison.

`prompts` (token-ID prompts and fingerprints), `metrics` (/metrics scrapes and their
deltas), `client` (the server and one timed stream), `prefill`, `decode`, `report`
(versioned JSON and Markdown), `compare`, `plot`, `cli`.
"""
