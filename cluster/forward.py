"""A port-forward to a Service that outlives what ends ``kubectl port-forward``.

kubectl's port-forward ends on the first connection that the pod's side resets: client-go's
``tools/portforward/portforward.go`` (``handleConnection``) closes the whole stream connection
when one connection's error stream reports an error, and kubectl exits with ``lost connection
to pod``; it also ends when its pod goes away. Until someone starts it again, every call is
refused. Seen on the test cluster: 4 of 20 ``argo list`` calls in a row refused, each after a
``connection reset by peer`` from argo server's side.

This process keeps the listening address itself (the one clients are told to use) and hands
each connection it accepts to a ``kubectl port-forward`` on a port of kubectl's choosing, which
it starts again whenever it ends; a connection that arrives in between waits for the next one
(up to ``--wait`` seconds) instead of being refused. A connection that was open through the
kubectl that ended is lost with it, as it would be with kubectl alone.

    python3 cluster/forward.py 127.0.0.1:2746 2746 -- --kubeconfig K -n argo svc/argo-server

Standard library only: cluster/up.sh runs it with the host's python3.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import sys
import time

FORWARDING = re.compile(rb"^Forwarding from 127\.0\.0\.1:(\d+) ->")
CHUNK = 1 << 16
RESENDS = 3              # a connection is sent again through at most this many kubectls


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} forward: {message}", file=sys.stderr, flush=True)


class Forward:
    """One listening address in front of a kubectl port-forward that is kept running."""

    def __init__(self, remote: int, kubectl_args: list[str], wait: float):
        self.remote, self.kubectl_args, self.wait = remote, kubectl_args, wait
        self.upstream: int | None = None          # kubectl's local port while it runs
        self.ready = asyncio.Event()
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    async def keep_kubectl(self) -> None:
        """Run kubectl port-forward, and again each time it ends."""
        while True:
            self.starts += 1
            self.proc = await asyncio.create_subprocess_exec(
                "kubectl", "port-forward", *self.kubectl_args, f":{self.remote}",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL)
            errors = asyncio.ensure_future(self._last_error(self.proc.stderr))
            await self._read_port(self.proc.stdout)
            code = await self.proc.wait()
            self.ready.clear()
            self.upstream = None
            log(f"kubectl port-forward ended (exit {code}: {await errors or 'no message'}); "
                "starting it again")
            await asyncio.sleep(0.2)

    async def _read_port(self, stdout: asyncio.StreamReader) -> None:
        """Learn kubectl's port from its first line; drain the rest (a line per connection)."""
        while line := await stdout.readline():
            if self.upstream is None and (match := FORWARDING.match(line)):
                self.upstream = int(match[1])
                self.ready.set()

    @staticmethod
    async def _last_error(stderr: asyncio.StreamReader) -> str:
        last = ""
        while line := await stderr.readline():
            last = line.decode(errors="replace").strip()[:300] or last
        return last

    async def _connect(self):
        """A connection to kubectl's listener, waiting for a kubectl that is starting."""
        deadline = time.monotonic() + self.wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self.ready.wait(), left)
                return await asyncio.open_connection("127.0.0.1", self.upstream)
            except (OSError, TypeError):        # it ended between ready and connect
                await asyncio.sleep(0.1)
            except asyncio.TimeoutError:
                break
        return None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Relay one client connection. One that the kubectl it went to ended with before any
        byte came back (accepted into its listen queue as it died) is sent again through the
        next kubectl: nothing reached the server then (a TLS handshake answers first)."""
        link = _Link(writer)
        sending = asyncio.ensure_future(link.send(reader))
        try:
            for _ in range(RESENDS + 1):
                generation = self.starts
                upstream = await self._connect()
                if upstream is None:
                    log(f"no kubectl port-forward within {self.wait:g} s: connection closed")
                    break
                link.attach(upstream[1])
                if await link.receive(upstream[0]) or not await self._ended(generation):
                    break
        finally:
            sending.cancel()
            link.close()

    async def _ended(self, generation: int, within: float = 3.0) -> bool:
        """Whether the kubectl of ``generation`` has ended (or does within ``within`` s)."""
        deadline = time.monotonic() + within
        while self.starts == generation and self.ready.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.starts != generation or not self.ready.is_set()

    def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()


class _Link:
    """One client connection and the upstream connection it is relayed through now. The
    client's bytes are kept until the first byte comes back, so that they can be sent again."""

    def __init__(self, client: asyncio.StreamWriter):
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.unanswered = bytearray()
        self.answered = self.client_done = False

    def attach(self, upstream: asyncio.StreamWriter) -> None:
        """Relay through ``upstream`` from now on, first what it has not answered yet."""
        if self.upstream is not None:
            self.upstream.close()
        upstream.write(bytes(self.unanswered))      # no await before the switch: in order
        self.upstream = upstream
        if self.client_done and upstream.can_write_eof():
            upstream.write_eof()

    async def send(self, reader: asyncio.StreamReader) -> None:
        """Client to upstream, until the client's end (passed on as a half close)."""
        while data := await reader.read(CHUNK):
            if not self.answered:
                self.unanswered += data
            if self.upstream is None:                # attach() sends it
                continue
            with contextlib.suppress(ConnectionError, OSError):
                self.upstream.write(data)
                await self.upstream.drain()
        self.client_done = True
        with contextlib.suppress(ConnectionError, OSError):
            if self.upstream is not None and self.upstream.can_write_eof():
                self.upstream.write_eof()

    async def receive(self, reader: asyncio.StreamReader) -> bool:
        """Upstream to client, until upstream's end; whether any byte came back."""
        try:
            while data := await reader.read(CHUNK):
                self.answered = True
                self.unanswered.clear()
                self.client.write(data)
                await self.client.drain()
        except (ConnectionError, OSError):
            pass
        return self.answered

    def close(self) -> None:
        for writer in (self.upstream, self.client):
            if writer is not None:
                writer.close()


async def serve(host: str, port: int, forward: Forward) -> None:
    server = await asyncio.start_server(forward.handle, host, port)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    keeper = asyncio.ensure_future(forward.keep_kubectl())
    log(f"listening on {host}:{port}, forwarding to port {forward.remote} of "
        f"{forward.kubectl_args[-1]}")
    await done.wait()
    keeper.cancel()
    forward.stop()
    server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("listen", help="HOST:PORT to listen on, e.g. 127.0.0.1:2746")
    parser.add_argument("remote", type=int, help="the port of the Service or pod")
    parser.add_argument("kubectl_args", nargs="+",
                        help="after --: kubectl port-forward's arguments before the port "
                             "(--kubeconfig, -n, the Service or pod)")
    parser.add_argument("--wait", type=float, default=30.0,
                        help="seconds a connection waits for a kubectl that is starting")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    asyncio.run(serve(host, int(port), Forward(args.remote, args.kubectl_args, args.wait)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
