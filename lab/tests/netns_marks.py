"""The skip marker of tests that need network namespaces (the emulated
cluster of lab/cluster): one check, one reason, for every such test
(conftest.py repeats the tag in the terminal summary)."""
import pytest

from lab.cluster import netns

NETNS_OK, NETNS_WHY = netns.available()
needs_netns = pytest.mark.skipif(not NETNS_OK, reason=f"NETNS TESTS SKIPPED: {NETNS_WHY}")
