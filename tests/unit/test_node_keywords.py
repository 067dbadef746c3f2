"""The framework layers' node arguments (hierarchical= / local_size= /
node_of_rank= / intra_fabric=) as the hierarchical reducer's keywords:
one helper, gtopk_plugin.two_level.topology.node_keywords, serves DDP and Horovod."""
import pytest

from gtopk_plugin.two_level.topology import node_keywords


def test_flat_is_none():
    assert node_keywords(False) is None
    assert node_keywords(False, None, None, None) is None


@pytest.mark.parametrize("kw", [dict(local_size=2), dict(node_of_rank=[0, 0, 1]), dict(intra_fabric="engine")])
def test_node_arguments_without_hierarchical_are_refused(kw):
    with pytest.raises(ValueError, match="pass hierarchical=True with them"):
        node_keywords(False, **kw)


def test_hierarchical_keywords():
    assert node_keywords(True) == {"local_size": None, "node_of_rank": None}
    assert node_keywords(True, local_size=2) == {"local_size": 2, "node_of_rank": None}
    nodes = (0, 0, 1)
    kw = node_keywords(True, node_of_rank=nodes, intra_fabric="engine")
    assert kw == {"local_size": None, "node_of_rank": [0, 0, 1], "intra_fabric": "engine"}
    assert isinstance(kw["node_of_rank"], list)  # a copy: the caller's sequence may change later
