"""The decode graphs' memory limit (``--graph-memory-gb``, ``DecodeGraphs._room``): each graph
holds 12-14 MB of device memory at 48 layers, so a server meeting every batch size at every
context width would hold gigabytes. Once the graphs have taken the limit their number is capped
there; a new key takes the place of the graph replayed least recently, never of one replayed in
the last ``KEEP_STEPS`` steps, and the warm-up never drops one. The captures themselves need a
GPU (tests/gpu/test_graphs_gpu.py runs the real path); this checks the policy on the CPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from freetoken_engine.config import EngineConfig
from freetoken_engine.errors import ConfigError
from freetoken_engine.executor.graphs import DecodeGraphs

MB = 1_000_000


def graphs(limit_mb: int) -> DecodeGraphs:
    model = SimpleNamespace(rotaries=lambda: [])      # no rotary table to size
    return DecodeGraphs(model, None, None, torch.device("cpu"), torch.float32, 4096, 8, limit_mb * MB)


def capture(g: DecodeGraphs, key, evict: bool = True, mb: int = 10) -> bool:
    """What ``capture`` does around the real capture: ask for room, then hold the graph."""
    g.tried.add(key)
    if not g._room(evict):
        return False
    g._graphs[key] = SimpleNamespace(used=g.clock)
    g.held_bytes += mb * MB if len(g._graphs) > g.max_held else 0     # the driver reuses dropped graphs' memory
    g.max_held = max(g.max_held, len(g._graphs))
    return True


def replay(g: DecodeGraphs, key) -> None:
    g.clock += 1
    g._graphs[key].used = g.clock


@pytest.fixture
def limited():
    g = graphs(35)
    g.max_held = 0
    g.KEEP_STEPS = 8
    return g


def test_below_the_limit_every_key_is_captured_and_none_dropped(limited):
    for b in (1, 2, 3):
        assert capture(limited, (b, 256))
    assert len(limited) == 3 and limited.dropped == 0 and limited.cap is None


def test_past_the_limit_a_new_key_replaces_the_graph_replayed_least_recently(limited):
    for b in (1, 2, 3, 4):              # 40 MB: the fourth graph takes the graphs past 35 MB
        assert capture(limited, (b, 256))
    for _ in range(4):                  # batch 1 and 3 keep decoding; 2 and 4 go quiet
        replay(limited, (1, 256))
        replay(limited, (3, 256))
    assert capture(limited, (5, 256))
    assert limited.cap == 4 and len(limited) == 4 and limited.dropped == 1
    assert (2, 256) not in limited and (1, 256) in limited and (4, 256) in limited
    assert (2, 256) not in limited.tried           # when idle, the warm-up may capture it again
    assert limited.held_bytes == 40 * MB           # the new graph reused the dropped one's memory


def test_a_graph_replayed_in_the_last_steps_is_never_dropped(limited):
    for b in (1, 2, 3, 4):
        assert capture(limited, (b, 256))
    for b in (1, 2, 3, 4):
        replay(limited, (b, 256))       # all four replayed within KEEP_STEPS: the new key stays eager
    assert not capture(limited, (5, 256))
    assert len(limited) == 4 and limited.dropped == 0 and limited.refused == 1
    for _ in range(4):
        replay(limited, (1, 256))
    assert capture(limited, (5, 256)) and (2, 256) not in limited   # once one has gone quiet


def test_a_key_left_eager_is_captured_once_the_others_have_gone_quiet(limited):
    """Refused keys run eagerly and each eager step counts as a step: a batch that only decodes
    in a new key (every graph idle meanwhile) gets its graph after ``KEEP_STEPS`` steps, instead
    of waiting for a replay that never comes (the first GPU run of this limit: device run 126)."""
    for b in (1, 2, 3, 4):
        assert capture(limited, (b, 256))
    replay(limited, (4, 256))
    tries = 0
    while not capture(limited, (5, 256)):
        tries += 1
        assert tries < limited.KEEP_STEPS
    assert (1, 256) not in limited and (5, 256) in limited


def test_the_warm_up_only_captures_into_free_room(limited):
    for b in (1, 2, 3, 4):
        assert capture(limited, (b, 256))
    limited.clock += 100                # every graph long idle
    assert not capture(limited, (1, 512), evict=False)
    assert len(limited) == 4 and limited.dropped == 0


def test_after_a_resize_drops_every_graph_as_many_fit_again(limited):
    """A cache resize or a q* change drops every graph (they hold old addresses); the memory the
    driver kept lets the same number of graphs back without dropping any."""
    for b in (1, 2, 3, 4, 5):
        capture(limited, (b, 256))
        limited.clock += 10
    limited.clear()
    for b in (1, 2, 3, 4):
        assert capture(limited, (b, 256))
    assert len(limited) == 4 and limited.dropped == 1 and limited.held_bytes == 40 * MB


def test_no_limit_keeps_every_graph():
    g = graphs(0)
    g.max_held = 0
    for b in range(1, 9):
        for w in (256, 512, 1024, 2048):
            assert capture(g, (b, w))
    assert len(g) == 32 and g.dropped == 0


def test_a_negative_limit_is_refused_with_the_flag_named():
    with pytest.raises(ConfigError, match="--graph-memory-gb"):
        EngineConfig(model="x", graph_memory_gb=-1)
