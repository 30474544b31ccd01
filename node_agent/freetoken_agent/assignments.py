"""Assignments: which models this node must serve (``FreeTokenNode.spec.models`` or a local file).

``parse_models(list)`` validates the ``models:`` list of docs/contracts.md into frozen
``Assignment`` objects and raises ``AssignmentError`` on a bad entry. ``StandaloneFile``
reads the same list from a YAML file and re-reads it when its modification time changes;
a file that turns invalid keeps the last good list (and reports the error) rather than
stopping every engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import yaml

FORMATS = ("safetensors", "gguf", "packed", "default")
DEVICES = ("cpu", "cuda")
SPECULATIVE_METHODS = ("ngram", "mtp")   # the engine's --speculative-method; ngram is its default


class AssignmentError(ValueError):
    """A ``models:`` entry that does not follow the contract."""


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    dtype: str | None = None
    expert_cache_share: float = 0.9
    context_length: int | None = None
    decode_pause_ms: float | None = None   # engine.features.decodePauseMs
    prefill_chunk: int | None = None       # engine.features.prefillChunk
    state_checkpoints: int | None = None   # engine.features.stateCheckpoints (hybrid models)
    speculative_tokens: int | None = None  # engine.features.speculativeTokens (draft tokens per step)
    speculative_method: str = "ngram"      # engine.features.speculativeMethod (ngram | mtp); absent = ngram


@dataclass(frozen=True)
class Assignment:
    """One replica this node should run. Equality decides whether a running engine is reused."""

    key: str
    namespace: str
    model: str
    path: str | None  # None: the engine's embedded default model (or a url, fetched first)
    format: str
    port: int
    engine: EngineOptions = EngineOptions()
    api_key_secret: tuple[str, str] | None = None  # (secret name, key) in `namespace`
    api_key: str | None = None  # standalone mode: the key itself
    url: str | None = None      # source.url: downloaded into the agent's model store (fetch.py)
    sha256: str | None = None   # source.sha256: the url's download or the path's file must hash to it

    @property
    def served_name(self) -> str:
        return self.model


def _integer(features: dict, name: str, least: int, where: str) -> int | None:
    value = features.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        raise AssignmentError(f"{where}.engine.features.{name} must be an integer >= {least}, got {value!r}")
    return value


def _features(features: object, where: str) -> tuple[float | None, int | None, int | None, int | None, str]:
    """The engine features this agent knows from ``engine.features``: (decodePauseMs,
    prefillChunk, stateCheckpoints, speculativeTokens), each None when absent, and
    speculativeMethod ("ngram" when absent, the engine's default); other keys are for later
    engines and ignored."""
    if features is None:
        return None, None, None, None, "ngram"
    if not isinstance(features, dict):
        raise AssignmentError(f"{where}.engine.features must be a mapping")
    pause = features.get("decodePauseMs")
    if pause is not None and (isinstance(pause, bool) or not isinstance(pause, (int, float)) or not pause >= 0):
        raise AssignmentError(f"{where}.engine.features.decodePauseMs must be a number >= 0, got {pause!r}")
    drafts = _integer(features, "speculativeTokens", 0, where)
    if drafts is not None and drafts > 16:
        raise AssignmentError(f"{where}.engine.features.speculativeTokens must be at most 16, got {drafts}")
    method = features.get("speculativeMethod", "ngram")
    if method not in SPECULATIVE_METHODS:
        raise AssignmentError(f"{where}.engine.features.speculativeMethod must be one of {SPECULATIVE_METHODS}, "
                              f"got {method!r}")
    if method == "mtp" and not drafts:
        raise AssignmentError(f"{where}.engine.features.speculativeMethod mtp needs speculativeTokens >= 1")
    return ((float(pause) if pause is not None else None), _integer(features, "prefillChunk", 1, where),
            _integer(features, "stateCheckpoints", 0, where), drafts, method)


def _source(source: dict, where: str) -> tuple[str | None, str | None, str | None]:
    """(path, url, sha256) of a ``source`` mapping: exactly one of path, url or default: true."""
    if "pvc" in source:
        raise AssignmentError(f"{where}.source.pvc is not supported by the node agents (use path or url)")
    path, url, sha256 = source.get("path"), source.get("url"), source.get("sha256")
    given = [k for k, v in (("path", path), ("url", url), ("default", source.get("default"))) if v]
    if len(given) != 1:
        raise AssignmentError(f"{where}.source needs exactly one of `path`, `url` or `default: true`"
                              + (f", got {' and '.join(given)}" if given else ""))
    if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        raise AssignmentError(f"{where}.source.url must be an http:// or https:// URL")
    if sha256 is not None:
        if not (isinstance(sha256, str) and len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256)):
            raise AssignmentError(f"{where}.source.sha256 must be 64 lowercase hex digits")
        if path is None and url is None:
            raise AssignmentError(f"{where}.source.sha256 checks a downloaded or local file: use it with url or path")
    return (str(path) if path is not None else None), url, sha256


def _parse_one(item: object, index: int) -> Assignment:
    if not isinstance(item, dict):
        raise AssignmentError(f"models[{index}] must be a mapping")
    where = f"models[{index}]"
    model = item.get("model")
    if not isinstance(model, str) or not model:
        raise AssignmentError(f"{where}.model must be a non-empty string")
    namespace = str(item.get("namespace", "default"))
    key = str(item.get("key") or f"{namespace}.{model}")
    source = item.get("source")
    if source is None:
        source = {"default": True}
    if not isinstance(source, dict):
        raise AssignmentError(f"{where}.source must be a mapping")
    path, url, sha256 = _source(source, where)
    fmt = str(item.get("format", "default" if path is None and url is None else "safetensors"))
    if fmt not in FORMATS:
        raise AssignmentError(f"{where}.format must be one of {FORMATS}, got {fmt!r}")
    port = item.get("port")
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise AssignmentError(f"{where}.port must be an integer port, got {port!r}")
    eng = item.get("engine") or {}
    if not isinstance(eng, dict):
        raise AssignmentError(f"{where}.engine must be a mapping")
    device = str(eng.get("device", "cpu"))
    if device not in DEVICES:
        raise AssignmentError(f"{where}.engine.device must be one of {DEVICES}, got {device!r}")
    share = float(eng.get("expertCacheShare", 0.9))
    if not 0.0 < share <= 1.0:
        raise AssignmentError(f"{where}.engine.expertCacheShare must be in (0, 1], got {share}")
    ctx = eng.get("contextLength")
    pause, chunk, checkpoints, drafts, method = _features(eng.get("features"), where)
    options = EngineOptions(device=device, dtype=eng.get("dtype"), expert_cache_share=share,
                            context_length=int(ctx) if ctx is not None else None,
                            decode_pause_ms=pause, prefill_chunk=chunk, state_checkpoints=checkpoints,
                            speculative_tokens=drafts, speculative_method=method)
    secret = item.get("apiKeySecret")
    secret_ref = None
    if secret is not None:
        if not isinstance(secret, dict) or not secret.get("name") or not secret.get("key"):
            raise AssignmentError(f"{where}.apiKeySecret needs `name` and `key`")
        secret_ref = (str(secret["name"]), str(secret["key"]))
    api_key = item.get("apiKey")
    return Assignment(key=key, namespace=namespace, model=model, path=path, format=fmt, port=port,
                      engine=options, api_key_secret=secret_ref,
                      api_key=str(api_key) if api_key is not None else None, url=url, sha256=sha256)


def parse_models(models: object) -> dict[str, Assignment]:
    """Validate a ``models:`` list; returns assignments keyed by ``key`` (unique per node)."""
    if models is None:
        return {}
    if not isinstance(models, list):
        raise AssignmentError("models must be a list")
    out: dict[str, Assignment] = {}
    for i, item in enumerate(models):
        a = _parse_one(item, i)
        if a.key in out:
            raise AssignmentError(f"duplicate model key {a.key!r}")
        out[a.key] = a
    return out


class StandaloneFile:
    """A local YAML file ``{models: [...]}`` watched by modification time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mtime: int | None = None
        self._models: dict[str, Assignment] = {}
        self.error: str | None = None

    def read(self) -> dict[str, Assignment]:
        """The current assignments; re-parses only when the file changed."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError as exc:
            self.error = f"{self.path}: {exc.strerror}"
            return self._models
        if mtime == self._mtime:
            return self._models
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = yaml.safe_load(f) or {}
            if not isinstance(doc, dict):
                raise AssignmentError("top level must be a mapping with `models:`")
            self._models = parse_models(doc.get("models"))
            self.error = None
        except (yaml.YAMLError, AssignmentError, OSError) as exc:
            self.error = f"{self.path}: {' '.join(str(exc).split())}"     # one line (YAML's span three)
        self._mtime = mtime
        return self._models
