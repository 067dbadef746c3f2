"""Private process tooling: the local launcher of P gloo workers used by the
demo, the benchmarks and the tests."""
