"""Benchmarks: ratios measured side by side in one run; JSON + PNG + a printed table."""
