"""A file server with HTTP Range support, for serving the synthetic Task01 tar to the download
step as a user's web server serves the real one.

``python -m benchmarks.fileserver FILE [--host 127.0.0.1] [--port 0]`` serves FILE at
``/<name>``; in code, :class:`FileServer` is a context manager that serves from a thread.

What a client of a real server meets, and the download step relies on:

- ``GET`` and ``HEAD``; ``Content-Length``, a strong ``ETag`` and ``Last-Modified``
  (RFC 9110 8.8);
- one byte range (``Range: bytes=a-b``, ``bytes=a-``, ``bytes=-n``) answered ``206`` with
  ``Content-Range``, ``416`` past the end, and ``If-Range`` (13.1.5): a validator that no
  longer matches gets the whole file (``200``);
- bodies streamed from disk in 1 MiB reads, so a 9 GB tar costs no memory.

For fault tests, ``cut_after`` bytes into each of the first ``cuts`` bodies the server closes
the connection, as a dropped link does. Every response is logged (range asked, status, body
bytes sent) in :attr:`FileServer.log`.
"""
from __future__ import annotations

import argparse
import email.utils
import re
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 1 << 20
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass
class Response:
    path: str
    range: str | None
    status: int
    sent: int


@dataclass
class FileServer:
    """Serves ``files`` ({URL path: file}) on ``host``:``port`` (0: any free port)."""
    files: dict[str, Path]
    host: str = "127.0.0.1"
    port: int = 0
    cut_after: int | None = None
    cuts: int = 0
    log: list[Response] = field(default_factory=list)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((self.host, self.port), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return sum(r.sent for r in self.log)

    def take_cut(self) -> bool:
        """Whether this response is one of the first ``cuts`` to be cut short."""
        with self._lock:
            if self.cut_after is None or self.cuts <= 0:
                return False
            self.cuts -= 1
            return True

    def record(self, response: Response) -> None:
        with self._lock:
            self.log.append(response)

    def start(self) -> "FileServer":
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="fileserver")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FileServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def validators(file: Path) -> tuple[str, str]:
    """(ETag, Last-Modified) of ``file``: the ETag changes with its size or mtime."""
    info = file.stat()
    return (f'"{info.st_size:x}-{info.st_mtime_ns:x}"',
            email.utils.formatdate(info.st_mtime, usegmt=True))


def byte_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """The inclusive (first, last) byte of a single-range ``Range`` header; None for the
    whole file (no header, or one this server ignores, as RFC 9110 14.2 allows); "416" when
    no byte of it is in the file."""
    match = _RANGE.fullmatch((header or "").strip())
    if not match or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first == "":                                  # the last n bytes
        return (max(size - int(last), 0), size - 1) if int(last) and size else "416"
    if last and int(last) < int(first):             # not a range: ignored
        return None
    if int(first) >= size:
        return "416"
    return int(first), min(int(last), size - 1) if last else size - 1


def _handler(server: FileServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):   # the log above says what was served
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            file = server.files.get(self.path)
            asked = self.headers.get("Range")
            if file is None:
                return self._empty(404, asked)
            size = file.stat().st_size
            etag, modified = validators(file)
            if_range = self.headers.get("If-Range")
            span = byte_range(asked, size) if if_range in (None, etag, modified) else None
            if span == "416":
                return self._empty(416, asked, {"Content-Range": f"bytes */{size}"})
            first, last = span or (0, size - 1)
            self.send_response(206 if span else 200)
            if span:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            for name, value in (("Content-Length", str(last - first + 1)),
                                ("Content-Type", "application/x-tar"), ("ETag", etag),
                                ("Last-Modified", modified), ("Accept-Ranges", "bytes")):
                self.send_header(name, value)
            self.end_headers()
            sent = self._body(file, first, last) if body else 0
            server.record(Response(self.path, asked, 206 if span else 200, sent))

        def _body(self, file: Path, first: int, last: int) -> int:
            budget = server.cut_after if server.take_cut() else None
            sent = 0
            with open(file, "rb") as source:
                source.seek(first)
                while sent <= last - first:
                    chunk = source.read(min(CHUNK, last - first + 1 - sent))
                    if not chunk:                            # the file shrank meanwhile
                        self.close_connection = True
                        return sent
                    if budget is not None and sent + len(chunk) > budget:
                        self.wfile.write(chunk[:budget - sent])
                        self.close_connection = True
                        return budget
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):  # the client went away
                        self.close_connection = True
                        return sent
                    sent += len(chunk)
            return sent

        def _empty(self, status: int, asked: str | None, headers: dict | None = None) -> None:
            self.send_response(status)
            for name, value in {**(headers or {}), "Content-Length": "0"}.items():
                self.send_header(name, value)
            self.end_headers()
            server.record(Response(self.path, asked, status, 0))

    return Handler


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fileserver",
                                     description="Serve one file over HTTP with Range support.")
    parser.add_argument("file", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = FileServer({f"/{args.file.name}": args.file}, args.host, args.port)
    print(server.url(f"/{args.file.name}"), flush=True)
    try:
        server._server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
