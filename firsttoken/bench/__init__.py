"""Benchmarks: offline latency, a serving-load client, peer comparison, TTFT profiling, plots."""
