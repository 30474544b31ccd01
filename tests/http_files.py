"""A real HTTP file server on loopback for the agent's ``source.url`` tests.

It serves byte strings by path, answers Range requests with 206 (unless ``ignore_range``; with
``whole_206`` a 206 of the whole file, as a broken server might), can
require HTTP Basic credentials, can close the connection after ``cut_after`` bytes of a body
(once), and records every request's path and Range header.
"""

from __future__ import annotations

import base64
import http.server
import threading


class FileServer:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []      # (path without query, Range)
        self.ignore_range = False
        self.whole_206 = False
        self.cut_after: int | None = None
        self.basic_auth: tuple[str, str] | None = None
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:    # quiet
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                with server.lock:
                    server.requests.append((path, self.headers.get("Range")))
                    cut, server.cut_after = server.cut_after, None
                if server.basic_auth is not None:
                    want = "Basic " + base64.b64encode(":".join(server.basic_auth).encode()).decode()
                    if self.headers.get("Authorization") != want:
                        self.send_error(401, "Unauthorized")
                        return
                body = server.files.get(path)
                if body is None:
                    self.send_error(404, "Not Found")
                    return
                start, rng = 0, self.headers.get("Range")
                if rng and not server.ignore_range:
                    start = 0 if server.whole_206 else int(rng.removeprefix("bytes=").split("-")[0])
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                part = body[start:]
                self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                if cut is not None:
                    self.wfile.write(part[:cut])
                    self.wfile.flush()
                    self.connection.shutdown(2)      # the peer sees a body cut short
                    return
                self.wfile.write(part)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
