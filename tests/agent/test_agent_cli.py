"""`freetoken-agent` rejects bad input with one line on stderr and exit code 2."""

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
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, env, message):
    (tmp_path / "models.yaml").write_text("models: []\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME",)}
    p = subprocess.run(AGENT + args, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**clean, **env})
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr
