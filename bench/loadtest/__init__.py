"""The load-test harness behind `mox bench`: workloads, the streaming load generator, the runner
that replays one workload against each memory policy, and its report."""
