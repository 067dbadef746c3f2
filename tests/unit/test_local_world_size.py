"""torchrun's LOCAL_WORLD_SIZE as the default node size of the hierarchical
reducer: read by config.py (the only module that reads the environment),
resolved and validated by the topology, explicit arguments win."""
import pytest

from gtopk_plugin import config
from gtopk_plugin.collectives.transport import SingleProcessTransport
from gtopk_plugin.two_level.topology import agree, resolve


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), (" 4 ", 4), ("x2", "x2")])
def test_env_local_world_size(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert config.env_local_world_size() == expected


def test_env_layout_is_torchruns_contiguous_one():
    assert resolve(6, env_local_size=3) == (0, 0, 0, 1, 1, 1)
    assert resolve(4, env_local_size=2) == (0, 0, 1, 1)
    # explicit arguments take precedence over the environment
    assert resolve(4, local_size=4, env_local_size=2) == (0, 0, 0, 0)
    assert resolve(3, node_of_rank=[0, 1, 1], env_local_size=3) == (0, 1, 1)


@pytest.mark.parametrize("bad, match", [("x2", "local_size"), (0, "local_size"), (4, "does not divide")])
def test_bad_env_value_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        resolve(6, env_local_size=bad)
    # through the collective agreement (every rank gets the same error)
    with pytest.raises(ValueError, match="invalid node topology"):
        agree(SingleProcessTransport(), env_local_size=bad if bad != 4 else 2.5)


def test_missing_layout_names_torchrun():
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        resolve(4)
