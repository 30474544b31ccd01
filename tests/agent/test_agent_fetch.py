"""``source.url`` models: downloaded over real HTTP into the agent's store, checked, resumed and
unpacked safely (freetoken_agent/fetch.py)."""

import hashlib
import io
import os
import tarfile
import threading
from collections import namedtuple

import pytest
from http_files import FileServer

from freetoken_agent import fetch as fetch_mod
from freetoken_agent.fetch import FetchError, FetchStopped, UrlSource, check_file, fetch, redact

GGUF = b"GGUF" + bytes(range(256)) * 64          # 16 KiB that start like a GGUF file


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tar_of(files: dict[str, bytes], mode: str = "w:gz", extra=None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if extra is not None:
            extra(tf)
    return buf.getvalue()


@pytest.fixture
def server():
    s = FileServer()
    yield s
    s.close()


def test_a_gguf_is_downloaded_once_and_kept_by_its_sha256(server, tmp_path):
    server.files["/m.gguf"] = GGUF
    src = UrlSource(server.url("/m.gguf"), sha(GGUF))
    seen = []
    path = fetch(src, str(tmp_path), progress=lambda done, total: seen.append((done, total)))
    assert path == str(tmp_path / f"sha256-{sha(GGUF)}" / "model.gguf")
    assert open(path, "rb").read() == GGUF
    assert seen[-1] == (len(GGUF), len(GGUF))
    assert fetch(src, str(tmp_path)) == path                   # from the store: no second request
    assert len(server.requests) == 1
    assert sorted(os.listdir(tmp_path)) == [f"sha256-{sha(GGUF)}"]   # no .part or .tmp left


def test_a_tar_of_one_folder_is_that_folder(server, tmp_path):
    files = {"qwen/config.json": b'{"model_type": "qwen3_moe"}', "qwen/model.safetensors": b"w" * 5000}
    server.files["/q.tar.gz"] = tar_of(files)
    path = fetch(UrlSource(server.url("/q.tar.gz")), str(tmp_path))
    assert os.path.basename(path) == "qwen" and os.path.isdir(path)
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == b"w" * 5000
    server.files["/flat.tar"] = tar_of({"config.json": b"{}", "tokenizer.json": b"{}"}, mode="w")
    flat = fetch(UrlSource(server.url("/flat.tar")), str(tmp_path))
    assert os.path.basename(flat) == "model" and sorted(os.listdir(flat)) == ["config.json", "tokenizer.json"]
    server.files["/one.tar.xz"] = tar_of({"smol.gguf": GGUF}, mode="w:xz")        # a compressed GGUF
    assert open(fetch(UrlSource(server.url("/one.tar.xz")), str(tmp_path)), "rb").read() == GGUF


def test_a_wrong_sha256_is_refused_and_nothing_is_kept(server, tmp_path):
    server.files["/m.gguf"] = GGUF
    with pytest.raises(FetchError, match=f"sha256 is {sha(GGUF)}, not source.sha256 {'0' * 64}"):
        fetch(UrlSource(server.url("/m.gguf"), "0" * 64), str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_cut_download_resumes_where_it_stopped(server, tmp_path):
    server.files["/m.gguf"] = GGUF
    server.cut_after = 5000
    src = UrlSource(server.url("/m.gguf"), sha(GGUF))
    with pytest.raises(FetchError, match="resumes"):
        fetch(src, str(tmp_path))
    assert os.path.getsize(tmp_path / f"{src.key}.part") == 5000
    path = fetch(src, str(tmp_path))
    assert open(path, "rb").read() == GGUF
    assert server.requests[-1] == ("/m.gguf", "bytes=5000-")


def test_a_server_that_ignores_range_gets_the_file_from_the_start(server, tmp_path):
    server.files["/m.gguf"] = GGUF
    src = UrlSource(server.url("/m.gguf"), sha(GGUF))
    (tmp_path / f"{src.key}.part").write_bytes(b"stale bytes from another file")
    server.ignore_range = True
    assert open(fetch(src, str(tmp_path)), "rb").read() == GGUF


def test_a_206_from_another_offset_is_taken_from_the_start(server, tmp_path):
    server.files["/m.gguf"] = GGUF
    src = UrlSource(server.url("/m.gguf"), sha(GGUF))
    (tmp_path / f"{src.key}.part").write_bytes(GGUF[:100])
    server.whole_206 = True
    assert open(fetch(src, str(tmp_path)), "rb").read() == GGUF


def test_a_part_already_whole_is_not_downloaded_again(server, tmp_path):
    server.files["/m.gguf"] = GGUF
    src = UrlSource(server.url("/m.gguf"), sha(GGUF))
    (tmp_path / f"{src.key}.part").write_bytes(GGUF)           # the agent stopped before unpacking
    assert open(fetch(src, str(tmp_path)), "rb").read() == GGUF
    assert server.requests == [("/m.gguf", f"bytes={len(GGUF)}-")]   # answered 416 with the size


@pytest.mark.parametrize("unsafe", ["parent", "absolute", "symlink out", "device"])
def test_an_unsafe_archive_writes_nothing_outside_the_store(server, tmp_path, unsafe):
    """Names that leave the folder, links out of it and device files are refused; an absolute
    name is unpacked inside the folder (tarfile's data filter drops the leading /)."""
    def add(tf):
        info = tarfile.TarInfo({"parent": "m/../../evil", "absolute": "/tmp/evil-abs",
                                "symlink out": "m/link", "device": "m/dev"}[unsafe])
        if unsafe == "symlink out":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        elif unsafe == "device":
            info.type = tarfile.CHRTYPE
        else:
            info.size = 4
        tf.addfile(info, io.BytesIO(b"evil") if info.size else None)
    server.files["/bad.tar"] = tar_of({"m/config.json": b"{}"}, mode="w", extra=add)
    store = tmp_path / "store"
    if unsafe == "absolute":
        model = fetch(UrlSource(server.url("/bad.tar")), str(store))
        assert open(os.path.join(model, "tmp", "evil-abs"), "rb").read() == b"evil"
    else:
        with pytest.raises(FetchError, match="refused an unsafe archive member"):
            fetch(UrlSource(server.url("/bad.tar")), str(store))
        assert os.listdir(store) == []
    assert not (tmp_path / "evil").exists() and not os.path.exists("/tmp/evil-abs")


def test_http_errors_and_unreachable_hosts_are_one_line_without_secrets(server, tmp_path):
    secret_url = server.url("/missing.gguf").replace("http://", "http://alice:s3cret@") + "?sig=TOKEN123"
    with pytest.raises(FetchError) as exc:
        fetch(UrlSource(secret_url), str(tmp_path))
    msg = str(exc.value)
    assert "HTTP 404" in msg and server.url("/missing.gguf") in msg
    assert "s3cret" not in msg and "TOKEN123" not in msg and "alice" not in msg
    server.close()
    with pytest.raises(FetchError, match="refused|Connection"):
        fetch(UrlSource(server.url("/m.gguf")), str(tmp_path))


def test_credentials_in_the_url_are_sent_as_basic_auth(server, tmp_path):
    server.files["/private.gguf"] = GGUF
    server.basic_auth = ("alice", "s3 cret")
    with pytest.raises(FetchError, match="HTTP 401"):
        fetch(UrlSource(server.url("/private.gguf")), str(tmp_path))
    url = server.url("/private.gguf").replace("http://", "http://alice:s3%20cret@")
    assert open(fetch(UrlSource(url), str(tmp_path)), "rb").read() == GGUF


def test_redact_keeps_scheme_host_port_and_path_only():
    assert redact("https://u:p@example.com:8443/a/b.tar?X-Amz-Signature=abc#f") == "https://example.com:8443/a/b.tar"
    assert redact("http://[::1]:9/m.gguf") == "http://[::1]:9/m.gguf"


def test_a_file_that_is_no_model_is_refused(server, tmp_path):
    server.files["/page.html"] = b"<html>login</html>"
    with pytest.raises(FetchError, match="neither a GGUF file nor a tar archive"):
        fetch(UrlSource(server.url("/page.html")), str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_too_little_disk_is_said_before_downloading(server, tmp_path, monkeypatch):
    server.files["/m.gguf"] = GGUF
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(fetch_mod.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(FetchError, match=r"needs 0.00 GB and the model store .* has 0.00 GB free"):
        fetch(UrlSource(server.url("/m.gguf")), str(tmp_path))


def test_a_stop_ends_the_download_and_keeps_the_part(server, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_mod, "CHUNK", 1024)
    server.files["/m.gguf"] = GGUF
    stop = threading.Event()
    src = UrlSource(server.url("/m.gguf"))
    with pytest.raises(FetchStopped):
        fetch(src, str(tmp_path), stop=stop, progress=lambda done, total: done >= 4096 and stop.set())
    assert 4096 <= os.path.getsize(tmp_path / f"{src.key}.part") < len(GGUF)


def test_two_replicas_of_one_source_share_one_download(server, tmp_path):
    server.files["/m.gguf"] = GGUF
    src = UrlSource(server.url("/m.gguf"), sha(GGUF))
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(fetch(src, str(tmp_path)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and len(paths) == 3 and len(server.requests) == 1


def test_check_file_verifies_a_local_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(GGUF)
    check_file(str(f), sha(GGUF))
    with pytest.raises(FetchError, match=f"its sha256 is {sha(GGUF)}"):
        check_file(str(f), "1" * 64)
    with pytest.raises(FetchError, match="is a folder"):
        check_file(str(tmp_path), sha(GGUF))
    with pytest.raises(FetchError, match="No such file"):
        check_file(str(tmp_path / "absent.gguf"), sha(GGUF))


def test_prune_removes_only_what_no_assignment_uses_and_went_unused(server, tmp_path):
    store, day = tmp_path / "store", 86400.0
    server.files["/a.gguf"], server.files["/b.gguf"] = GGUF, GGUF + b"b"
    kept, old = UrlSource(server.url("/a.gguf")), UrlSource(server.url("/b.gguf"))
    for src in (kept, old):
        fetch(src, str(store))
    (store / "url-abandoned.part").write_bytes(b"half")
    (store / "url-crashed.tmp").mkdir()
    (store / "notes.txt").write_text("the owner's file")
    now = os.stat(store / kept.key / "source.json").st_mtime
    assert fetch_mod.prune(str(store), {kept.key}, 7 * day, now=now + day) == []      # all used lately
    removed = fetch_mod.prune(str(store), {kept.key}, 7 * day, now=now + 8 * day)
    assert removed == sorted([old.key, "url-abandoned.part", "url-crashed.tmp"])
    assert sorted(os.listdir(store)) == sorted([kept.key, "notes.txt"])
    assert fetch(old, str(store)) != ""                      # downloaded again when asked for again
    assert len(server.requests) == 3


def test_prune_leaves_an_entry_being_fetched_and_fetch_marks_its_use(server, tmp_path):
    server.files["/a.gguf"] = GGUF
    src = UrlSource(server.url("/a.gguf"))
    fetch(src, str(tmp_path))
    stamp = tmp_path / src.key / "source.json"
    os.utime(stamp, (1_000_000, 1_000_000))
    lock = fetch_mod._lock(src.key)
    with lock:                                               # another replica fetches it right now
        assert fetch_mod.prune(str(tmp_path), set(), 0.0) == []
    fetch(src, str(tmp_path))                                # found in the store: used now
    assert os.stat(stamp).st_mtime > 1_000_000 + 86400
    assert fetch_mod.prune(str(tmp_path), set(), 0.0) == [src.key]


async def test_the_agent_prunes_its_store_but_keeps_what_its_models_name(tmp_path):
    from freetoken_agent.agent import Agent
    from freetoken_agent.config import AgentConfig

    store = tmp_path / "store"
    named, other = UrlSource("https://h.example/a.tar"), UrlSource("https://h.example/b.tar")
    for src in (named, other):
        (store / src.key).mkdir(parents=True)
        (store / src.key / "source.json").write_text('{"path": "model"}')
        os.utime(store / src.key / "source.json", (1_000_000, 1_000_000))      # unused since 1970
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n- model: a\n  port: 19999\n  source: {{url: '{named.url}'}}\n")
    agent = Agent(AgentConfig(node_name="n1", standalone=str(models), state_dir=str(tmp_path),
                              model_store=str(store), calibrate_on_start=False))
    await agent._prune_store(agent.standalone.read())
    assert os.listdir(store) == [named.key]


async def test_a_refused_download_is_not_fetched_again_at_once(server, tmp_path):
    """A wrong sha256 means the whole file came for nothing: the replica waits refused_retry
    (15 min) before the next try, where a 404 is asked again on the engines' short backoff."""
    import asyncio

    from freetoken_agent.assignments import parse_models
    from freetoken_agent.replica import LaunchConfig, Replica

    server.files["/m.gguf"] = GGUF
    launch = LaunchConfig(engine_command=("false",), model_store=str(tmp_path), backoff_initial=0.05,
                          backoff_max=0.05)
    models = parse_models([
        {"model": "bad", "port": 19001, "source": {"url": server.url("/m.gguf"), "sha256": "0" * 64}},
        {"model": "gone", "port": 19002, "source": {"url": server.url("/gone.gguf")}}])
    replicas = [Replica(a, launch) for a in models.values()]
    for r in replicas:
        r.start()
    await asyncio.sleep(1.0)
    for r in replicas:
        await r.stop()
    asked = [p for p, _ in server.requests]
    assert asked.count("/m.gguf") == 1 and asked.count("/gone.gguf") >= 5
    assert replicas[0].restarts == 1
    assert replicas[0].message.endswith("(tried again in 15 min, or when the model's source changes)")


async def test_a_replica_logs_its_download_progress(server, tmp_path, monkeypatch, caplog):
    import asyncio
    import logging

    from freetoken_agent import replica as replica_mod
    from freetoken_agent.assignments import parse_models

    monkeypatch.setattr(replica_mod, "FETCH_LOG_SECONDS", 0.0)
    monkeypatch.setattr(fetch_mod, "CHUNK", 4096)
    server.files["/m.gguf"] = GGUF
    launch = replica_mod.LaunchConfig(engine_command=("false",), model_store=str(tmp_path))
    [a] = parse_models([{"model": "m", "port": 19003, "source": {"url": server.url("/m.gguf") + "?sig=S3CRET"}}]).values()
    r = replica_mod.Replica(a, launch)
    with caplog.at_level(logging.INFO, logger="freetoken_agent.replica"):
        assert await r._model_path() == str(tmp_path / UrlSource(a.url).key / "model.gguf")
        await asyncio.sleep(0)
    lines = [rec.getMessage() for rec in caplog.records if "fetching" in rec.getMessage()]
    assert lines[-1] == f"replica default.m: fetching 0.00 of 0.00 GB from {server.url('/m.gguf')}"
    assert len(lines) == 5 and "S3CRET" not in caplog.text          # one line per 4 KiB read here (16,388 bytes)
    assert r.fetched is None and r.message == ""
    await r.client.aclose()
