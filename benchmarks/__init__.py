"""Probe scripts: one question about speed each, run from a checkout (`python -m benchmarks.NAME`),
not installed. See README.md here."""
