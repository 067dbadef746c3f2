"""Emulated 1 GbE cluster on one machine: P worker network
namespaces on a bridge, each link shaped with tc, real gloo (and Horovod)
workers, and the gTop-k paper's three measurements.  Entry point:
``python -m lab.cluster`` (see :mod:`lab.cluster.cli`)."""
