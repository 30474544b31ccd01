"""A kmock KubernetesEmulator prepared for FreeToken, small HTTP helpers, and the operator run
under kopf against it with heartbeating nodes (test support).

kmock gaps handled here (see /work/shared/KUBERNETES_NOTES.md): objects get a seeded
``resourceVersion``/``uid`` (kopf's finalizer JSON patch tests the resourceVersion); every change
goes through HTTP so watchers see it; callers run kopf with ``-A``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gc
import io
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import kmock
from kopf.testing import KopfRunner

MODELS = "freetoken.io/v1alpha1/freetokenmodels"
NODES = "freetoken.io/v1alpha1/freetokennodes"
VERBS = {"list", "watch", "get", "patch", "create", "delete"}


def prepare(k: Any) -> None:
    k.resources.load_bundled()
    k.resources[MODELS] = kmock.ResourceInfo(kind="FreeTokenModel", singular="freetokenmodel", namespaced=True,
                                             shortnames={"ftm"}, subresources={"status"}, verbs=VERBS)
    k.resources[NODES] = kmock.ResourceInfo(kind="FreeTokenNode", singular="freetokennode", namespaced=False,
                                            shortnames={"ftn"}, subresources={"status"}, verbs=VERBS)


def seeded(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the server-managed metadata kmock does not assign."""
    meta = body.setdefault("metadata", {})
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("resourceVersion", "1")
    meta.setdefault("generation", 1)
    meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return body


def model_path(ns: str, name: str = "") -> str:
    return f"/apis/freetoken.io/v1alpha1/namespaces/{ns}/freetokenmodels" + (f"/{name}" if name else "")


def node_path(name: str = "") -> str:
    return "/apis/freetoken.io/v1alpha1/freetokennodes" + (f"/{name}" if name else "")


async def get(k: Any, path: str) -> dict[str, Any] | None:
    resp = await k.get(path)
    if resp.status == 404:
        return None
    resp.raise_for_status()
    return await resp.json()


async def items(k: Any, path: str) -> list[dict[str, Any]]:
    listed = await get(k, path)
    return [i for i in (listed or {}).get("items", []) if i]


async def patch(k: Any, path: str, body: dict[str, Any]) -> None:
    resp = await k.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"})
    resp.raise_for_status()


async def wait_for(check: Callable[[], Any], timeout: float, what: str, step: float = 0.1) -> Any:
    """Await ``check()`` (sync or async) until truthy; never blocks the loop kmock serves from."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(step)


def rbac_requests(k: Any, user_agents: tuple[str, ...]) -> set[tuple[str, str, str]]:
    """(verb, apiGroup, resource) of every recorded request whose User-Agent starts with one of
    ``user_agents``, in RBAC terms (``get``/``list``/``watch``, subresources as ``res/sub``).
    Discovery (``/api``, ``/apis/g/v``, ``/version``) is left out: every user may read it."""
    out = set()
    for i in range(len(k)):
        req = k[i]
        if not str(req.headers.get("User-Agent", "")).startswith(user_agents):
            continue
        parts = [p for p in str(req.url.path).split("/") if p]
        if parts[:1] == ["api"]:
            group, rest = "", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) > 3:
            group, rest = parts[1], parts[3:]
        else:
            continue
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            rest = rest[2:]
        if not rest:
            continue
        resource = rest[0] + (f"/{rest[2]}" if len(rest) >= 3 else "")
        method = str(req.method).upper().rsplit(".", 1)[-1]
        if method == "GET":
            verb = "watch" if req.url.query.get("watch") in ("true", "1") else ("get" if len(rest) >= 2 else "list")
        else:
            verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}[method]
        out.add((verb, group, resource))
    return out


# -- the operator under kopf, with nodes heartbeating as agents would --------------------------
def node_body(name: str, ip: str) -> dict:
    """A FreeTokenNode as an agent on a 2-core CPU machine reports it."""
    return seeded({"apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenNode", "metadata": {"name": name},
                   "status": {"heartbeat": now(), "mode": "cpu", "address": ip, "cpuCores": 2,
                              "ramTotalBytes": 8 * 2**30, "ramAvailableBytes": 6 * 2**30,
                              "pcieGbps": None, "cpuExpertGbps": 5.0, "fillFraction": 1.0,
                              "memoryPressure": False, "replicas": []}})


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def heartbeats(k, alive: set[str]) -> None:
    while True:
        for name in sorted(alive):
            await patch(k, node_path(name) + "/status", {"status": {"heartbeat": now()}})
        await asyncio.sleep(0.3)


RUN_ARGS = ["run", "--standalone", "-A", "-m", "freetoken_operator.handlers"]


@contextlib.asynccontextmanager
async def running_operator(kmock, monkeypatch, alive: set[str], **env: str):
    """kopf running the operator unmodified against kmock, with heartbeats from the ``alive``
    nodes (a test may change the set while it runs); yields the ``KopfRunner``."""
    monkeypatch.setenv("FREETOKEN_OPERATOR_KUBE_SERVER", str(kmock.url).rstrip("/"))
    monkeypatch.setenv("FREETOKEN_OPERATOR_RESYNC_SECONDS", "0.2")
    # a call kmock leaves unanswered gives up well inside the runner's 30 s stop
    monkeypatch.setenv("FREETOKEN_OPERATOR_API_TIMEOUT_SECONDS", "5")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    beats = asyncio.create_task(heartbeats(kmock, alive))
    runner = KopfRunner(RUN_ARGS, timeout=30)
    runner.__enter__()
    failure = (None, None, None)
    try:
        yield runner
    except BaseException as exc:
        failure = (type(exc), exc, exc.__traceback__)
        raise
    finally:
        beats.cancel()
        # the runner's exit joins the operator's thread: off this loop, which serves kmock, so that
        # calls the operator has in flight while it stops are answered (joined on the loop, they
        # waited for the loop: the test's teardown hung until pytest's timeout)
        try:
            await asyncio.to_thread(runner.__exit__, *failure)
        except Exception as exc:
            exc.add_note(_threads())   # which call held the operator's stop
            raise


def _threads() -> str:
    """The stacks of every thread (faulthandler cannot: kopf's runner has swapped sys.stderr) and
    of the tasks on every other running event loop (kopf's)."""
    out = [f"--- thread {ident}\n" + "".join(traceback.format_stack(frame))
           for ident, frame in sys._current_frames().items()]
    here = asyncio.get_running_loop()
    for loop in [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]:
        if loop is here or not loop.is_running():
            continue
        for task in list(asyncio.all_tasks(loop)):
            buf = io.StringIO()
            task.print_stack(file=buf)
            out.append(f"--- task {task.get_name()}\n{buf.getvalue()}")
    return "\n".join(out)
