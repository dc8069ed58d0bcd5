"""Microbenchmarks, each a `python -m mox.bench.micro.<name>` command that writes its result
under bench/results/: kernels, the expert reader, cold starts, decode throughput, the router
following a traffic shift, and the GPU checks."""
