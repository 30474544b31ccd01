"""`freetoken-agent` rejects bad input with one line on stderr and exit code 2."""

import asyncio
import logging
import os
import subprocess
import sys

import pytest

AGENT = [sys.executable, "-m", "freetoken_agent.cli"]


@pytest.mark.parametrize("args,env,message", [
    (["run", "--standalone", "models.yaml"], {}, "--node-name"),
    (["run", "--node-name", "n", "--standalone", "missing.yaml"], {}, "no such file"),
    (["run", "--node-name", "n", "--standalone", "models.yaml"],
     {"FREETOKEN_AGENT_COOLDOWN_SECONDS": "soon"}, "FREETOKEN_AGENT_COOLDOWN_SECONDS"),
    (["run", "--node-name", "n", "--standalone", "models.yaml"],
     {"FREETOKEN_AGENT_HEADROOM_FRACTION": "2"}, "headroom_fraction"),
    (["run", "--node-name", "n", "--standalone", "models.yaml", "--metrics-port", "70000"], {}, "metrics-port"),
    (["run", "--node-name", "n", "--standalone", "models.yaml", "--log-level", "LOUD"], {},
     "--log-level: invalid choice: 'LOUD'"),                          # was a traceback
    (["run", "--node-name", "n", "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    (["run", "--node-name", "n", "--standalone", "broken.yaml"], {}, "broken.yaml: while parsing"),
    (["run", "--node-name", "n", "--standalone", "typo.yaml"], {}, "port"),   # both ran, silently
    # these three ran and failed later, every heartbeat or at each engine start
    (["run", "--node-name", "Gaming_PC", "--kube-server", "http://127.0.0.1:9"], {}, "cannot name a FreeTokenNode"),
    (["run", "--node-name", "n", "--kube-server", "apiserver:6443"], {}, "must be an http(s):// URL"),
    (["run", "--node-name", "n", "--standalone", "models.yaml", "--address", "999.1.1.1"], {},
     "neither an IP address nor a host name"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, env, message):
    (tmp_path / "models.yaml").write_text("models: []\n")
    (tmp_path / "broken.yaml").write_text("models: [ {{{\n")
    (tmp_path / "typo.yaml").write_text("models: [ {model: c, port: nope} ]\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME",)}
    p = subprocess.run(AGENT + args, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**clean, **env})
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr


def test_an_edit_that_breaks_the_standalone_file_is_logged_once_and_changes_nothing(tmp_path, caplog):
    """While the agent runs, a typo in its file keeps the engines it had and says so in one error
    line (it was only a condition no standalone user reads); fixing it says so too."""
    from freetoken_agent import config as config_mod
    from freetoken_agent.agent import Agent
    f = tmp_path / "models.yaml"
    f.write_text("models:\n- model: a\n  port: 2001\n")
    cfg = config_mod.from_env(node_name="n", standalone=str(f), state_dir=str(tmp_path / "state"),
                              metrics_port=0)
    agent = Agent(cfg)
    assert list(asyncio.run(agent.desired())) == ["default.a"]
    caplog.set_level(logging.INFO, logger="freetoken_agent")
    f.write_text("models: [ {model: c, port: nope} ]\n")
    os.utime(f, ns=(2 * 10**18, 2 * 10**18))
    for _ in range(3):
        assert list(asyncio.run(agent.desired())) == ["default.a"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "port" in errors[0] and str(f) in errors[0], errors
    f.write_text("models: []\n")
    os.utime(f, ns=(3 * 10**18, 3 * 10**18))
    assert asyncio.run(agent.desired()) == {} and agent.assignment_error is None
    assert any("valid again" in r.getMessage() for r in caplog.records)
