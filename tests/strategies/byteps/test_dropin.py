"""The byteps.torch calls that need no servers: init twice, calls before init, Compression."""

import pytest

import polytrain
import polytrain.byteps as bps
from polytrain import ConfigError
from tests.harness import spawn


def test_a_call_before_init_says_so():
    assert not polytrain.is_initialized()
    with pytest.raises(ConfigError, match=r"bps\.size\(\) was called before bps\.init\(\)"):
        bps.size()
    with pytest.raises(ConfigError, match=r"bps\.rank\(\) was called before bps\.init\(\)"):
        bps.rank()


def test_compression_members_follow_the_names_rules():
    assert bps.Compression.none is None
    assert bps.Compression.fp16.spec() == "fp16"
    assert bps.Compression.topk(0.01).spec() == "topk:0.01"
    assert bps.Compression.dithering(4, natural=True).spec() == "dithering:4:natural"
    with pytest.raises(ConfigError, match="topk:0: K must be"):
        bps.Compression.topk(0)
    with pytest.raises(ConfigError, match="dithering:1"):
        bps.Compression.dithering(1)


def init_twice():
    bps.init()
    try:
        bps.init()
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_init_twice_is_refused():
    [message] = spawn(init_twice, workers=1)
    assert message == ("bps.init() was called twice in this process. HINT: call bps.init() "
                       "once, at the start of the script")
