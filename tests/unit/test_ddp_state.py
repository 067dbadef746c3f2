"""SparseState keyword handling (no process group needed): a method's own
hyper-parameters, declared in the registry, reach the reducer; keywords no
method declares are refused with a message naming what is accepted."""
import pickle

import pytest

from gtopk_plugin import registry
from gtopk_plugin.torch_ddp import SparseState


def test_method_hyper_parameters_pass_through():
    s = SparseState(method="powersgd", rank=2)
    assert s.reducer.compressor.rank == 2
    s = SparseState(method="qsgd", levels=3, bucket_size=8)
    assert (s.reducer.compressor.levels, s.reducer.compressor.bucket_size) == (3, 8)


def test_pickled_state_keeps_the_hyper_parameters():
    s = pickle.loads(pickle.dumps(SparseState(method="powersgd", rank=3)))
    assert s.reducer.compressor.rank == 3


def test_keyword_of_another_method_is_refused():
    with pytest.raises(ValueError, match="unknown SparseState keyword.*'rank'"):
        SparseState(method="gtopk", rank=2)
    with pytest.raises(ValueError, match="'powersgd' also takes"):
        SparseState(method="powersgd", levels=2)


def test_out_of_range_hyper_parameter_is_refused():
    with pytest.raises(ValueError):
        SparseState(method="powersgd", rank=0)


def test_every_registered_method_builds_with_defaults():
    for name in registry.available():
        SparseState(method=name)


def test_intra_fabric_is_a_hierarchical_keyword():
    with pytest.raises(ValueError, match="intra_fabric=.*hierarchical=True"):
        SparseState(intra_fabric="engine")
    with pytest.raises(ValueError, match="intra_fabric must be one of"):
        SparseState(hierarchical=True, local_size=2, intra_fabric="nvlink")
    s = SparseState(hierarchical=True, local_size=2, intra_fabric="engine")
    # the node level's mode, and kept through pickling (a DDP checkpoint)
    assert s.reducer._fabric_mode == "engine"
    assert pickle.loads(pickle.dumps(s)).reducer._fabric_mode == "engine"
