"""Benchmarks and the load-test harness, imported as `mox.bench`. Timing lives here, never in
tests; results are ratios measured within one run."""
