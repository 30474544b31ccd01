"""Static checks of the Dockerfiles (no Docker engine here, no hadolint): non-root user that
matches the chart, PYTHONSAFEPATH, no torch in the operator image, CUDA base for the agent,
version labels and chart image tags equal to the package version, entrypoints that exist."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml

from crdcheck import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
VALUES = yaml.safe_load((ROOT / "charts" / "freetoken" / "values.yaml").read_text())
CHART = yaml.safe_load((ROOT / "charts" / "freetoken" / "Chart.yaml").read_text())


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = (ROOT / "docker" / name).read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name,component,script", [
    ("operator.Dockerfile", "operator", "freetoken-operator"),
    ("agent.Dockerfile", "agent", "freetoken-agent"),
])
def test_dockerfile_basics(name, component, script):
    ins = instructions(name)
    users = [a for i, a in ins if i == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0   # numeric, so runAsNonRoot can verify it
    expected_uid = VALUES["agent"]["runAsUser"] if component == "agent" else 10001
    assert int(uid) == expected_uid
    assert ins.index(("USER", users[-1])) > max(i for i, (w, _) in enumerate(ins) if w == "RUN")
    env = " ".join(a for i, a in ins if i == "ENV")
    assert "PYTHONSAFEPATH=1" in env
    assert f"ARG VERSION={VERSION}" in [f"{i} {a}" for i, a in ins]
    assert VALUES[component]["image"]["tag"] == VERSION == CHART["appVersion"]
    entry = [a for i, a in ins if i == "ENTRYPOINT"][-1]
    assert entry == f'["{script}"]' and script in PYPROJECT["project"]["scripts"]


def test_operator_image_has_no_torch():
    runs = " ".join(a for i, a in instructions("operator.Dockerfile") if i == "RUN")
    assert "--no-deps" in runs
    assert re.search(r"pip install [^&]*torch", runs) is None
    assert '! python -c "import torch"' in runs   # the build itself proves it


def test_agent_image_is_cuda_based():
    base = [a for i, a in instructions("agent.Dockerfile") if i == "FROM"][-1]
    assert base.startswith("nvidia/cuda:") and "runtime" in base
