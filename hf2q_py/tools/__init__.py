"""Tools built on the library: the command line, A/B checks, benchmarks and
their workloads, offline replay, and DFlash drafter training."""
