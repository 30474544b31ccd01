"""kopf registrations: watch events feed the Store, one background Reconciler does the work.

Load with ``kopf run -A -m freetoken_operator.handlers`` or through ``freetoken-operator``.
Settings: finalizer ``freetoken.io/finalizer`` on FreeTokenModels (deletion stops engines and
removes the Service and EndpointSlices before the object goes); kopf's own bookkeeping lives in
``freetoken.io/*`` annotations, not in ``status``. FreeTokenNodes and Nodes are only watched
(no finalizer, no bookkeeping), so the agent owns their lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from .apply import Applier, api_client
from .config import OperatorConfig
from .observe import Store
from .reconciler import Reconciler
from .resources import FINALIZER, GROUP, MODELS, NODES, VERSION


def plain(obj: Any) -> Any:
    """A deep plain-dict copy of a kopf body view (the Store keeps its own copies)."""
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    return obj


def _config(memo: Any) -> OperatorConfig:
    cfg = memo.get("config") if isinstance(memo, Mapping) else getattr(memo, "config", None)
    return cfg if isinstance(cfg, OperatorConfig) else OperatorConfig.from_env()


@kopf.on.login()
def login(memo: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
    server = _config(memo).kube_server
    if server:
        return kopf.ConnectionInfo(server=server)
    return kopf.login_via_client(**kwargs)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, logger: logging.Logger, **_: Any) -> None:
    config = _config(memo)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="freetoken.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="freetoken.io", key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.networking.error_backoffs = [1, 2, 5, 10]
    store = Store()
    applier = Applier(api_client(config.kube_server), timeout=config.api_timeout_seconds)
    reconciler = Reconciler(config, store, applier)
    memo["config"], memo["store"], memo["reconciler"] = config, store, reconciler
    memo["task"] = asyncio.create_task(reconciler.run(), name="freetoken-reconciler")
    logger.info("freetoken operator: stale after %gs, resync %gs", config.stale_seconds, config.resync_seconds)


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    task = memo.get("task")
    if task is not None:
        await memo["reconciler"].stop(task)


@kopf.on.event(GROUP, VERSION, MODELS)
def model_event(event: Mapping[str, Any], body: Any, memo: Any, **_: Any) -> None:
    memo["store"].put_model(plain(body), deleted=event.get("type") == "DELETED")
    memo["reconciler"].poke()


@kopf.on.event(GROUP, VERSION, NODES)
def node_event(event: Mapping[str, Any], body: Any, memo: Any, **_: Any) -> None:
    memo["store"].put_node(plain(body), deleted=event.get("type") == "DELETED")
    memo["reconciler"].poke()


@kopf.on.event("v1", "nodes")
def k8s_node_event(event: Mapping[str, Any], body: Any, memo: Any, **_: Any) -> None:
    memo["store"].put_k8s_node(plain(body), deleted=event.get("type") == "DELETED")
    memo["reconciler"].poke()


@kopf.on.delete(GROUP, VERSION, MODELS)
async def model_deleted(body: Any, name: str, namespace: str, memo: Any, **_: Any) -> None:
    """Finalizer: drop the model from every node's spec, then delete its Service and slices.
    An API error keeps the finalizer and retries in 5 s (kopf.TemporaryError)."""
    memo["store"].put_model(plain(body))   # carries deletionTimestamp: the plan drops it
    try:
        await memo["reconciler"].reconcile_once()
        await asyncio.to_thread(memo["reconciler"].applier.forget_model, namespace, name)
    except ApiException as exc:
        raise kopf.TemporaryError(f"cleanup of {namespace}/{name} failed: {exc.status} {exc.reason}",
                                  delay=5) from exc
