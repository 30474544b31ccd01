"""Engine command lines and restart backoff (the live lifecycle is in test_agent_e2e.py)."""

import pytest

from freetoken_agent.assignments import parse_models
from freetoken_agent.replica import LaunchConfig, backoff_delay, serve_command


def test_serve_command_follows_the_engine_contract():
    [a] = parse_models([{"model": "qwen", "namespace": "ml", "port": 1919,
                         "source": {"path": "/models/qwen3"},
                         "engine": {"device": "cuda", "dtype": "bfloat16"}}]).values()
    launch = LaunchConfig(engine_command=("freetoken",), bind_host="10.0.0.5", port_offset=100)
    cmd = serve_command(a, launch, admin_token="t0k", api_key="sk", cpu_expert_fraction=0.25)
    assert cmd[:2] == ["freetoken", "serve"]
    opts = dict(zip(cmd[2::2], cmd[3::2]))
    assert opts == {"--host": "10.0.0.5", "--port": "2019", "--served-model-name": "qwen",
                    "--admin-token": "t0k", "--device": "cuda", "--model": "/models/qwen3",
                    "--dtype": "bfloat16", "--expert-cache-experts": "1",
                    "--cpu-expert-fraction": "0.2500", "--api-key": "sk"}


def test_default_model_sends_no_model_flag():
    [a] = parse_models([{"model": "tiny", "port": 2000}]).values()
    cmd = serve_command(a, LaunchConfig(engine_command=("x",)), "t", None, None)
    assert "--model" not in cmd and "--api-key" not in cmd and "--cpu-expert-fraction" not in cmd


def test_backoff_doubles_to_a_cap():
    assert [backoff_delay(n, 1.0, 30.0) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.parametrize("kw", [dict(engine_command=()), dict(engine_command=("x",), backoff_max=0.5),
                                dict(engine_command=("x",), failure_threshold=0)])
def test_launch_config_validated(kw):
    with pytest.raises(ValueError):
        LaunchConfig(**kw)
