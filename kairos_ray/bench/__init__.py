"""Benchmarks that print figures (never timed assertions)."""
