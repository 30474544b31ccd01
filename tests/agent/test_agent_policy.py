"""The pressure policy as a pure function: one row per situation a node owner can cause."""

import pytest

from freetoken_agent.policy import CacheState, Observation, PolicyConfig, PolicyState, decide

MB = 1_000_000
# 10 MB experts; floor 2 experts (20 MB), max 50 experts (500 MB).
CFG = PolicyConfig(headroom_bytes=100 * MB, headroom_fraction=0.0, hysteresis_bytes=50 * MB,
                   cooldown_seconds=10.0, grow_interval_seconds=2.0, grow_step_fraction=0.2)


def cache(key="a", experts=30):
    return CacheState(key, experts * 10 * MB, 10 * MB, 2, 50)


def obs(used, caches=(cache(),), now=100.0, total=1000 * MB, ours=None, psi=None):
    ours = sum(c.capacity_bytes for c in caches) if ours is None else ours
    return Observation(now, total, used, ours, tuple(caches), psi)


CASES = [
    # name, observation, state, expected action, expected targets, expected pressure
    ("plenty free, in the band: hold",
     obs(used=860 * MB), PolicyState(), "hold", {}, False),
    ("foreign use eats the headroom: shrink at once by what is missing, whole experts",
     obs(used=950 * MB), PolicyState(), "shrink", {"a": 250 * MB}, False),
    ("shrink ignores the cool-down (owner first)",
     obs(used=950 * MB), PolicyState(last_shrink_at=99.9), "shrink", {"a": 250 * MB}, False),
    ("a full device releases a whole headroom",
     obs(used=1000 * MB), PolicyState(), "shrink", {"a": 200 * MB}, False),
    ("a game wants everything: down to the floor, pressure flagged",
     obs(used=1000 * MB, caches=(cache(experts=10),)), PolicyState(), "shrink", {"a": 20 * MB}, True),
    ("already at the floor and still pressed: hold, pressure stays",
     obs(used=990 * MB, caches=(cache(experts=2),)), PolicyState(), "hold", {}, True),
    ("at the floor but the headroom is back: no pressure",
     obs(used=850 * MB, caches=(cache(experts=2),)), PolicyState(), "hold", {}, False),
    ("room to grow but inside the cool-down: hold",
     obs(used=500 * MB), PolicyState(last_shrink_at=95.0), "hold", {}, False),
    ("after the cool-down: grow by one step (20% of max = 100 MB)",
     obs(used=500 * MB), PolicyState(last_shrink_at=85.0), "grow", {"a": 400 * MB}, False),
    ("between grow steps: hold",
     obs(used=500 * MB), PolicyState(last_grow_at=99.0), "hold", {}, False),
    ("grow never eats into headroom + hysteresis",
     obs(used=820 * MB), PolicyState(), "grow", {"a": 330 * MB}, False),
    ("grow stops at the maximum",
     obs(used=600 * MB, caches=(cache(experts=48),)), PolicyState(), "grow", {"a": 500 * MB}, False),
    ("every cache full: hold",
     obs(used=600 * MB, caches=(cache(experts=50),)), PolicyState(), "hold", {}, False),
    ("two engines share a shrink in proportion to their size above the floor",
     obs(used=980 * MB, caches=(cache("a", 30), cache("b", 12))), PolicyState(), "shrink",
     {"a": 240 * MB, "b": 90 * MB}, False),
    ("host PSI stall (CPU mode) shrinks a quarter above the floor even with MemAvailable fine",
     obs(used=860 * MB, psi=40.0), PolicyState(), "shrink", {"a": 230 * MB}, False),
    ("no engine ready yet: nothing to do, no pressure",
     obs(used=990 * MB, caches=(), ours=0), PolicyState(), "hold", {}, False),
]


@pytest.mark.parametrize("name,o,state,action,targets,pressure", CASES, ids=[c[0] for c in CASES])
def test_policy_table(name, o, state, action, targets, pressure):
    d = decide(CFG, o, state)
    assert (d.action, d.targets, d.memory_pressure) == (action, targets, pressure), d.reason


def test_shrink_restores_the_headroom():
    """After applying a shrink, the owner has at least the headroom free again."""
    o = obs(used=970 * MB, caches=(cache("a", 40), cache("b", 25)))
    d = decide(CFG, o, PolicyState())
    released = sum(c.capacity_bytes for c in o.caches) - sum(d.targets.values())
    assert o.free_bytes + released >= CFG.headroom(o.total_bytes)


def test_load_comes_and_goes():
    """Simulate a node ticking once a second: a 700 MB foreign load arrives at t=5 and leaves
    at t=20. The cache shrinks on the first tick that sees it, keeps shrinking only while the
    device is full, then holds steady under the load (no oscillation); it regrows to its
    maximum only after the cool-down, in steps."""
    total, nonexpert = 1000 * MB, 100 * MB
    c, st, log = cache(experts=50), PolicyState(), []
    for step in range(60):
        foreign = 700 * MB if 5 <= step < 20 else 0
        used = min(total, foreign + nonexpert + c.capacity_bytes)  # a device never exceeds its size
        d = decide(CFG, Observation(float(step), total, used, nonexpert + c.capacity_bytes, (c,)), st)
        st = d.state
        log.append((d.action, c.capacity_bytes, total - used))
        if d.targets:
            c = CacheState("a", d.targets["a"], 10 * MB, 2, 50)
    shrinks = [i for i, (a, _, _) in enumerate(log) if a == "shrink"]
    assert shrinks[0] == 5 and shrinks == list(range(5, shrinks[-1] + 1))  # at once, contiguous
    assert all(free >= CFG.headroom(total) for _, _, free in log[shrinks[-1] + 1:20])
    assert all(a == "hold" for a, _, _ in log[shrinks[-1] + 1:20])
    grows = [i for i, (a, _, _) in enumerate(log) if a == "grow"]
    assert grows and grows[0] >= shrinks[-1] + CFG.cooldown_seconds and grows[0] >= 20
    assert len(grows) > 1  # slowly: more than one step back
    assert c.capacity_bytes == 500 * MB


@pytest.mark.parametrize("kwargs", [dict(headroom_fraction=1.5), dict(grow_step_fraction=0.0),
                                    dict(headroom_bytes=-1), dict(cooldown_seconds=-1.0)])
def test_config_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        PolicyConfig(**kwargs)
