"""Engine command lines and restart backoff (the live lifecycle is in test_agent_e2e.py)."""

import subprocess
import sys

import pytest

from freetoken_agent.assignments import parse_models
from freetoken_agent.replica import LaunchConfig, backoff_delay, serve_command, serve_env


def test_serve_command_follows_the_engine_contract():
    [a] = parse_models([{"model": "qwen", "namespace": "ml", "port": 1919,
                         "source": {"path": "/models/qwen3"},
                         "engine": {"device": "cuda", "dtype": "bfloat16", "contextLength": 8192,
                                    "features": {"decodePauseMs": 250, "prefillChunk": 4096, "stateCheckpoints": 6,
                                                 "speculativeTokens": 4, "later": 1}}}]).values()
    launch = LaunchConfig(engine_command=("freetoken",), bind_host="10.0.0.5", port_offset=100)
    cmd = serve_command(a, launch, cpu_expert_fraction=0.25)
    assert cmd[:2] == ["freetoken", "serve"]
    opts = dict(zip(cmd[2::2], cmd[3::2]))
    assert opts == {"--host": "10.0.0.5", "--port": "2019", "--served-model-name": "qwen",
                    "--device": "cuda", "--model": "/models/qwen3",
                    "--dtype": "bfloat16", "--max-context": "8192", "--decode-pause-ms": "250",
                    "--prefill-chunk": "4096", "--state-checkpoints": "6", "--speculative-tokens": "4",
                    "--expert-cache-experts": "1",
                    "--cpu-expert-fraction": "0.2500"}
    # the command is one the engine's CLI takes, and the options reach its config
    from freetoken_engine.cli import build_parser
    from freetoken_engine.server.serve import engine_config
    cfg = engine_config(build_parser().parse_args(cmd[1:]))
    assert (cfg.max_context, cfg.decode_pause, cfg.prefill_tokens, cfg.state_checkpoints,
            cfg.speculative_tokens) == (8192, 250, 4096, 6, 4)


@pytest.mark.parametrize("features,flag", [
    ({"speculativeTokens": 3}, None),
    ({"speculativeTokens": 3, "speculativeMethod": "ngram"}, None),   # the engine's default is not sent
    ({"speculativeTokens": 3, "speculativeMethod": "mtp"}, "mtp"),
])
def test_serve_command_passes_a_speculative_method_other_than_ngram(features, flag):
    [a] = parse_models([{"model": "qwen", "port": 1919, "source": {"path": "/models/qwen3"},
                         "engine": {"features": features}}]).values()
    cmd = serve_command(a, LaunchConfig(engine_command=("freetoken",)), None)
    opts = dict(zip(cmd[2::2], cmd[3::2]))
    assert opts["--speculative-tokens"] == "3" and opts.get("--speculative-method") == flag
    assert ("--speculative-method" in cmd) == (flag is not None)
    from freetoken_engine.cli import build_parser
    from freetoken_engine.server.serve import engine_config
    cfg = engine_config(build_parser().parse_args(cmd[1:]))
    assert (cfg.speculative_tokens, cfg.speculative_method) == (3, flag or "ngram")


def test_secrets_travel_in_the_environment_not_the_command_line(monkeypatch):
    # In argv a secret is visible to every local user (ps), and a token starting with "-" read
    # as an option made `freetoken serve` exit ("expected one argument"): one start in 64.
    monkeypatch.setenv("FREETOKEN_API_KEY", "inherited")
    env = serve_env(admin_token="-t0k", api_key=None)
    assert env["FREETOKEN_ADMIN_TOKEN"] == "-t0k" and "FREETOKEN_API_KEY" not in env
    assert serve_env("t", "sk")["FREETOKEN_API_KEY"] == "sk"
    code = ("import sys; from freetoken_engine.cli import build_parser; "
            "a = build_parser().parse_args(['serve']); print(a.admin_token, a.api_key)")
    out = subprocess.run([sys.executable, "-c", code], env=serve_env("-dash-token", "sk-1"),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["-dash-token", "sk-1"], out.stderr


def test_default_model_sends_no_model_flag():
    [a] = parse_models([{"model": "tiny", "port": 2000}]).values()
    cmd = serve_command(a, LaunchConfig(engine_command=("x",)), None)
    assert "--model" not in cmd and "--api-key" not in cmd and "--cpu-expert-fraction" not in cmd


def test_backoff_doubles_to_a_cap():
    assert [backoff_delay(n, 1.0, 30.0) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.parametrize("kw", [dict(engine_command=()), dict(engine_command=("x",), backoff_max=0.5),
                                dict(engine_command=("x",), failure_threshold=0)])
def test_launch_config_validated(kw):
    with pytest.raises(ValueError):
        LaunchConfig(**kw)


@pytest.mark.parametrize("address,endpoint,local", [
    ("10.0.0.5", "http://10.0.0.5:1919", "http://10.0.0.5:1919"),
    ("fd00::5", "http://[fd00::5]:1919", "http://[fd00::5]:1919"),    # was http://fd00::5:1919
    ("::", "http://[::]:1919", "http://127.0.0.1:1919"),
])
def test_a_replicas_urls_are_urls_on_ipv6_nodes_too(address, endpoint, local):
    """The endpoint the agent reports (the operator publishes it in EndpointSlices) and the one
    it checks the engine on; an IPv6 node address needs brackets."""
    import urllib.parse

    from freetoken_agent.replica import Replica
    [a] = parse_models([{"model": "m", "port": 1919}]).values()
    r = Replica(a, LaunchConfig(engine_command=("x",), address=address, bind_host=address))
    assert r.endpoint == endpoint and r.client.base_url == local
    assert urllib.parse.urlsplit(r.endpoint).port == 1919
