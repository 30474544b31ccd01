"""Model sources the agent fetches: ``source.url`` (with an optional ``sha256``) into a store on
the node's disk, and the ``sha256`` check of a ``source.path`` file.

What a URL may hold (told apart by its bytes, whatever ``format`` says):
- one GGUF file, kept as ``model.gguf``;
- a tar archive (plain, gzip, bzip2 or xz) of a Hugging Face folder or of a packed folder
  (``freetoken convert``), or of one GGUF file. It is unpacked with tarfile's ``data`` filter,
  which refuses names that leave the folder (``..``), links that leave it and device files, and
  unpacks an absolute name inside the folder. If the archive holds one folder or one GGUF file
  and nothing else, that is the model.

The store keeps one entry per source, named by the ``sha256`` when given (two URLs of the same
file share it), else by a hash of the URL:

    STORE/<key>.part     the download so far; the next try resumes it with a Range request
    STORE/<key>.tmp/     being unpacked
    STORE/<key>/         the model, with source.json written last: an entry without it is not used

``prune`` removes what no assignment uses any more once it has not been used for a while (the
mtime of source.json, touched by every ``fetch`` that finds the entry, or of a partial file).

``fetch`` blocks: the replica runs it in a thread and passes a ``threading.Event`` that stops it
between reads. Messages and logs show a URL without its credentials, query or fragment
(``redact``): a presigned URL's signature never reaches a status or a log line.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import logging
import os
import shutil
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_checked: set[tuple[str, int, int, str]] = set()   # (path, size, mtime_ns, sha256) already verified

Progress = Callable[[int, "int | None"], None]


class FetchError(Exception):
    """The source could not be made ready; the message is one line for the replica's status.
    ``refused``: the whole file came and is not usable (a wrong sha256, no model, an unsafe
    archive): trying again at once would only download it again (the replica waits longer)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class FetchStopped(Exception):
    """The replica was stopped while its source was being fetched or checked."""


@dataclass(frozen=True)
class UrlSource:
    url: str
    sha256: str | None = None

    @property
    def key(self) -> str:
        if self.sha256:
            return f"sha256-{self.sha256}"
        return "url-" + hashlib.sha256(self.url.encode()).hexdigest()[:40]


def redact(url: str) -> str:
    """``url`` without user information, query or fragment: what a status or a log may show."""
    p = urllib.parse.urlsplit(url)
    host = p.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{p.port}" if p.port else host
    return urllib.parse.urlunsplit((p.scheme, netloc, p.path, "", ""))


def gigabytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f}"


def _lock(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _stopped(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise FetchStopped()


def _hash_file(path: str, digest, stop: threading.Event | None) -> int:
    """Feed ``path`` into ``digest``; its size in bytes."""
    n = 0
    with open(path, "rb") as f:
        while buf := f.read(CHUNK):
            _stopped(stop)
            digest.update(buf)
            n += len(buf)
    return n


def finished(store: str, src: UrlSource) -> str | None:
    """The model's path if the store holds ``src`` complete, else None."""
    entry = os.path.join(store, src.key)
    try:
        with open(os.path.join(entry, "source.json"), encoding="utf-8") as f:
            rel = json.load(f)["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = os.path.normpath(os.path.join(entry, rel))
    return path if path.startswith(entry + os.sep) and os.path.exists(path) else None


def fetch(src: UrlSource, store: str, *, progress: Progress | None = None,
          stop: threading.Event | None = None, timeout: float = 20.0) -> str:
    """The local path of ``src``'s model (a .gguf file or a folder), downloaded, checked and
    unpacked into ``store`` unless it is there already. Raises FetchError or FetchStopped."""
    lock = _lock(src.key)
    while not lock.acquire(timeout=0.2):      # another replica fetches the same source
        _stopped(stop)
    try:
        return _fetch_locked(src, store, progress, stop, timeout)
    finally:
        lock.release()


def _fetch_locked(src: UrlSource, store: str, progress: Progress | None, stop: threading.Event | None,
                  timeout: float) -> str:
    done = finished(store, src)
    if done is not None:
        with contextlib.suppress(OSError):
            os.utime(os.path.join(store, src.key, "source.json"))     # last used: now (prune)
        return done
    try:
        os.makedirs(store, exist_ok=True)
    except OSError as exc:
        raise FetchError(f"cannot create the model store {store}: {exc.strerror}") from None
    part = os.path.join(store, src.key + ".part")
    started = time.monotonic()
    digest, size = _download(src, part, store, progress, stop, timeout)
    if src.sha256 and digest != src.sha256:
        os.remove(part)
        raise FetchError(f"{redact(src.url)}: the download's sha256 is {digest}, "
                         f"not source.sha256 {src.sha256}", refused=True)
    path = _unpack(src, part, store, stop)
    log.info("fetched %s (%s GB in %.0f s) into %s", redact(src.url), gigabytes(size),
             time.monotonic() - started, path)
    return path


def _request(src: UrlSource, start: int) -> urllib.request.Request:
    p = urllib.parse.urlsplit(src.url)
    netloc = p.netloc.rpartition("@")[2]
    req = urllib.request.Request(urllib.parse.urlunsplit((p.scheme, netloc, p.path, p.query, "")),
                                 headers={"User-Agent": "freetoken-agent"})
    if p.username is not None:      # user:password@host; not sent again after a redirect
        cred = f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password or '')}"
        req.add_unredirected_header("Authorization", "Basic " + base64.b64encode(cred.encode()).decode())
    if start:
        req.add_header("Range", f"bytes={start}-")
    return req


def _open(src: UrlSource, start: int, timeout: float):
    where = redact(src.url)
    try:
        return urllib.request.urlopen(_request(src, start), timeout=timeout)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and start:   # the part is already whole, or the file shrank
            whole = _content_range(exc.headers)[1]
            return -1 if whole is None else whole
        raise FetchError(f"{where}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise FetchError(f"{where}: {getattr(exc.reason, 'strerror', None) or exc.reason}") from None
    except (OSError, ValueError) as exc:      # timeouts, resets; a URL urllib cannot open
        raise FetchError(f"{where}: {exc}") from None


def _content_range(headers) -> tuple[int | None, int | None]:
    """(start, whole size) of ``Content-Range: bytes START-END/SIZE`` (a 416's ``bytes */SIZE``)."""
    span, _, whole = (headers.get("Content-Range") or "").removeprefix("bytes ").rpartition("/")
    start = span.partition("-")[0]
    return (int(start) if start.isdigit() else None), (int(whole) if whole.isdigit() else None)


def _total(resp) -> int | None:
    """The whole file's size from a 206's Content-Range or a 200's Content-Length."""
    if resp.status == 206:
        return _content_range(resp.headers)[1]
    length = resp.headers.get("Content-Length")
    return int(length) if length and length.isdigit() else None


def _download(src: UrlSource, part: str, store: str, progress: Progress | None,
              stop: threading.Event | None, timeout: float) -> tuple[str, int]:
    """Download into ``part``, resuming what is there; (sha256 hex, size)."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    digest = hashlib.sha256()
    if have:
        _hash_file(part, digest, stop)
    resp = _open(src, have, timeout)
    if isinstance(resp, int):                         # 416 with the file's size
        if resp == have:
            return digest.hexdigest(), have           # downloaded whole before a restart
        os.remove(part)                               # the file changed: from the start
        have, digest = 0, hashlib.sha256()
        resp = _open(src, 0, timeout)
    with resp:
        if have and (resp.status != 206 or _content_range(resp.headers)[0] != have):
            have, digest = 0, hashlib.sha256()       # the server ignored the Range: start over
        total = _total(resp)
        if total is not None:
            _need_space(store, total - have, f"downloading {redact(src.url)}")
        with open(part, "ab" if have else "wb") as f:
            while True:
                _stopped(stop)
                try:
                    buf = resp.read(CHUNK)
                except (OSError, ValueError, http.client.HTTPException) as exc:
                    raise FetchError(f"{redact(src.url)}: {exc or type(exc).__name__} after "
                                     f"{gigabytes(have)} GB; the next try resumes") from None
                if not buf:
                    break
                f.write(buf)
                digest.update(buf)
                have += len(buf)
                if progress is not None:
                    progress(have, total)
    if total is not None and have != total:
        raise FetchError(f"{redact(src.url)}: the connection closed at {have} of {total} bytes; "
                         "the next try resumes")
    return digest.hexdigest(), have


def _need_space(store: str, nbytes: int, what: str) -> None:
    free = shutil.disk_usage(store).free
    if nbytes > free:
        raise FetchError(f"{what} needs {gigabytes(nbytes)} GB and the model store {store} "
                         f"has {gigabytes(free)} GB free")


def _unpack(src: UrlSource, part: str, store: str, stop: threading.Event | None) -> str:
    """Turn the finished download into STORE/<key>/; the model's path inside it."""
    tmp, entry = os.path.join(store, src.key + ".tmp"), os.path.join(store, src.key)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(part, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic == GGUF_MAGIC:
        os.replace(part, os.path.join(tmp, "model.gguf"))
        rel = "model.gguf"
    elif tarfile.is_tarfile(part):
        rel = _untar(src, part, tmp, store, stop)
        os.remove(part)
    else:
        os.remove(part)
        shutil.rmtree(tmp, ignore_errors=True)
        raise FetchError(f"{redact(src.url)} is neither a GGUF file nor a tar archive of a model folder "
                         f"(it starts with {magic!r})", refused=True)
    with open(os.path.join(tmp, "source.json"), "w", encoding="utf-8") as f:
        json.dump({"url": redact(src.url), "sha256": src.sha256, "path": rel,
                   "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp, entry)
    return os.path.join(entry, rel)


def _untar(src: UrlSource, part: str, tmp: str, store: str, stop: threading.Event | None) -> str:
    if not hasattr(tarfile, "data_filter"):
        raise FetchError("this Python's tarfile has no data filter (3.11.4 or later): "
                         "archives cannot be unpacked safely")
    where = redact(src.url)
    target = os.path.join(tmp, "model")
    try:
        with tarfile.open(part, "r:*") as tf:
            members = tf.getmembers()
            _need_space(store, sum(m.size for m in members if m.isfile()), f"unpacking {where}")
            for m in members:
                _stopped(stop)
                tf.extract(m, target, filter="data")
    except tarfile.FilterError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        os.remove(part)
        raise FetchError(f"{where}: refused an unsafe archive member ({exc})", refused=True) from None
    except (tarfile.TarError, EOFError, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, OSError):
            os.remove(part)
        raise FetchError(f"{where}: cannot unpack the archive: {exc}",
                         refused=not isinstance(exc, OSError)) from None
    names = os.listdir(target)
    if not names:
        shutil.rmtree(tmp, ignore_errors=True)
        os.remove(part)
        raise FetchError(f"{where}: the archive is empty", refused=True)
    one = os.path.join(target, names[0])
    if len(names) == 1 and (os.path.isdir(one) or (names[0].endswith(".gguf") and os.path.isfile(one))):
        return f"model/{names[0]}"
    return "model"


def stored_sha256(store: str) -> tuple[str, ...]:
    """The sha256 of every finished entry named by one (what the operator matches models by)."""
    try:
        names = os.listdir(store)
    except OSError:
        return ()
    return tuple(sorted(n.removeprefix("sha256-") for n in names if n.startswith("sha256-")
                        and len(n) == 71 and os.path.exists(os.path.join(store, n, "source.json"))))


def prune(store: str, keep: set[str], older_than: float, now: float | None = None) -> list[str]:
    """Remove the store's entries (models, partial downloads, unpacking leftovers) whose key is
    not in ``keep`` and that were last used ``older_than`` seconds ago or earlier; an entry being
    fetched is left alone. The names removed."""
    now = time.time() if now is None else now
    try:
        names = sorted(os.listdir(store))
    except OSError:
        return []
    removed = []
    for name in names:
        key = name.removesuffix(".part").removesuffix(".tmp")
        if key in keep or not key.startswith(("sha256-", "url-")):
            continue
        path = os.path.join(store, name)
        folder = os.path.isdir(path)
        try:
            used = os.stat(os.path.join(path, "source.json") if folder and name == key else path).st_mtime
        except OSError:
            used = float("-inf")              # a model folder without source.json is unfinished
        lock = _lock(key)
        if now - used < older_than or not lock.acquire(blocking=False):
            continue
        try:
            shutil.rmtree(path) if folder else os.remove(path)
            removed.append(name)
        except OSError as exc:
            log.warning("model store: cannot remove %s: %s", path, exc.strerror)
        finally:
            lock.release()
    return removed


def check_file(path: str, sha256: str, stop: threading.Event | None = None) -> None:
    """Raise FetchError unless the file at ``path`` hashes to ``sha256`` (checked once per
    path, size and modification time)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise FetchError(f"source.path {path}: {exc.strerror}") from None
    if os.path.isdir(path):
        raise FetchError(f"source.sha256 checks a file, and source.path {path} is a folder")
    memo = (path, st.st_size, st.st_mtime_ns, sha256)
    if memo in _checked:
        return
    digest = hashlib.sha256()
    try:
        _hash_file(path, digest, stop)
    except OSError as exc:
        raise FetchError(f"source.path {path}: {exc.strerror}") from None
    if digest.hexdigest() != sha256:
        raise FetchError(f"source.path {path}: its sha256 is {digest.hexdigest()}, not source.sha256 {sha256}")
    _checked.add(memo)
