"""An API server that accepts connections and never answers: the operator's writes give up within
their timeout, and its shutdown waits for the pass that is writing (bounded), so no API call is
left running after the operator has stopped."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from freetoken_operator.apply import Applier, api_client
from freetoken_operator.config import OperatorConfig
from freetoken_operator.observe import Store
from freetoken_operator.reconciler import Reconciler
from freetoken_operator.status import DesiredState, Event

TIMEOUT = 0.5


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A TCP server that accepts and reads every connection and never writes a byte."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = sock.accept()
                held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        sock.close()


def _state_with_event() -> DesiredState:
    event = Event(namespace="default", name="m", uid="u1", type="Normal", reason="Placed", message="on a")
    return DesiredState(node_specs={}, model_status={}, services=[], slices={}, events=[event])


def test_a_write_to_a_server_that_never_answers_fails_within_its_timeout():
    with silent_server() as url:
        applier = Applier(api_client(url), timeout=TIMEOUT)
        start = time.monotonic()
        with pytest.raises(Exception) as caught:   # urllib3's read timeout, not an ApiException
            applier.apply(_state_with_event(), {}, {})
        took = time.monotonic() - start
    assert "timed out" in str(caught.value).lower(), caught.value
    assert took < 10 * TIMEOUT, took   # not held for good (a POST is not retried)


def test_the_default_timeout_is_set_and_configurable():
    assert OperatorConfig().api_timeout_seconds == 30.0
    config = OperatorConfig.from_env({"FREETOKEN_OPERATOR_API_TIMEOUT_SECONDS": "5"})
    assert config.api_timeout_seconds == 5.0


@pytest.mark.timeout(60)
async def test_shutdown_waits_for_the_writing_pass_and_leaves_no_call_running():
    """A pass is writing to a server that does not answer when the operator stops: ``stop``
    returns once the pass has given up, with its worker thread done (a plain cancel returned at
    once and left the call running in its thread)."""
    with silent_server() as url:
        config = OperatorConfig(kube_server=url, api_timeout_seconds=TIMEOUT, resync_seconds=0.05)
        store = Store()
        store.put_model({"apiVersion": "freetoken.io/v1alpha1", "kind": "FreeTokenModel",
                          "metadata": {"name": "m", "namespace": "default", "uid": "u1", "generation": 1},
                          "spec": {"source": {"default": True}, "replicas": 1}})
        reconciler = Reconciler(config, store, Applier(api_client(url), timeout=TIMEOUT))
        calls: list[threading.Thread] = []
        apply = reconciler.applier.apply

        def tracked(*args):
            calls.append(threading.current_thread())
            return apply(*args)

        reconciler.applier.apply = tracked
        task = asyncio.create_task(reconciler.run())
        while not calls:
            await asyncio.sleep(0.01)
        await reconciler.stop(task)
        assert task.done()
        # the worker thread may live on in the pool, idle; what must not run is the applier
        assert not any(_in_applier(t) for t in calls)


def _in_applier(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "apply" and "freetoken_operator" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@pytest.mark.timeout(60)
async def test_stop_ends_an_idle_or_backing_off_loop_at_once_without_a_cancel():
    """Between passes (waiting for the tick, or backing off after failed passes: up to 30 s) the
    loop ends as soon as ``stop`` is called, by its flag: no cancel is needed, so none can be lost."""
    with silent_server() as url:
        config = OperatorConfig(kube_server=url, api_timeout_seconds=TIMEOUT, resync_seconds=60)
        store = Store()
        reconciler = Reconciler(config, store, Applier(api_client(url), timeout=TIMEOUT))
        task = asyncio.create_task(reconciler.run())
        await asyncio.sleep(0.2)          # waiting for its 60 s tick
        start = time.monotonic()
        await reconciler.stop(task)
        assert task.done() and not task.cancelled() and time.monotonic() - start < 1.0

        reconciler = Reconciler(config, store, Applier(api_client(url), timeout=TIMEOUT))
        failed = []

        async def failing_pass():
            failed.append(time.monotonic())
            raise RuntimeError("the API server said no")

        reconciler.reconcile_once = failing_pass
        task = asyncio.create_task(reconciler.run())
        while len(failed) < 3:            # backs off 1 s, 2 s, then 4 s: past stop's 1 s bound
            reconciler.poke()
            await asyncio.sleep(0.05)
        start = time.monotonic()
        await reconciler.stop(task)
        assert task.done() and not task.cancelled() and time.monotonic() - start < 1.0
