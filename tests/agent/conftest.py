"""Fixtures for the agent tests: a kmock API server that knows the FreeTokenNode CRD."""

import pytest

NODES = "freetoken.io/v1alpha1/freetokennodes"


@pytest.fixture
def kube(kmock):
    """kmock with the bundled k3s resources (Secrets) plus the FreeTokenNode CRD."""
    kmock.resources.load_bundled()
    kmock.resources[NODES] = kmock.ResourceInfo(
        kind="FreeTokenNode", namespaced=False, subresources={"status"},
        verbs={"list", "watch", "get", "patch", "create", "delete"})
    return kmock
