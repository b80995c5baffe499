"""Benchmarks: multi-turn serving through the core (bench) and storage microbenchmarks (bench-io)."""
