"""A port-forward to a Service that outlives what ends ``kubectl port-forward``.

kubectl's port-forward ends on the first connection that the pod's side resets: client-go's
``tools/portforward/portforward.go`` (``handleConnection``) closes the whole stream connection
when one connection's error stream reports an error, and kubectl exits with ``lost connection
to pod``; it also ends when its pod goes away. Until someone starts it again, every call is
refused. Seen on the test cluster: 4 of 20 ``argo list`` calls in a row refused, each after a
``connection reset by peer`` from argo server's side.

This process keeps the listening address itself (the one clients are told to use) and hands
each connection it accepts to a ``kubectl port-forward`` of its own, on a port of kubectl's
choosing, started ahead so that a connection seldom waits; the kubectl is stopped when its
connection ends. A reset stream then ends one connection's kubectl and no other connection
(with one shared kubectl, the reset that followed one call's end cut the next call: 1 of 200
calls failed). A connection whose kubectl ended before any byte came back is sent again
through the next one (nothing reached the server then: TLS answers first). No call is
refused while kubectl starts: it waits up to ``--wait`` seconds.

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
SPARES = 2               # kubectls started ahead, ready for the next connections


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} forward: {message}", file=sys.stderr, flush=True)


class Kubectl:
    """One ``kubectl port-forward`` on a port of its choosing, for one connection."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, errors: asyncio.Future):
        self.proc, self.port, self.errors = proc, port, errors

    async def ended(self, within: float) -> bool:
        """Whether it has ended, or does within ``within`` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), within)
        return self.proc.returncode is not None

    def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()


class Forward:
    """One listening address; each connection through a kubectl port-forward of its own,
    started ahead (``SPARES`` wait ready), so that what ends one kubectl (a stream the server
    resets, even after its connection closed) ends no other connection."""

    def __init__(self, remote: int, kubectl_args: list[str], wait: float):
        self.remote, self.kubectl_args, self.wait = remote, kubectl_args, wait
        self.ready: asyncio.Queue[Kubectl] = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()     # held: a pending task is not collected
        self.procs: set[asyncio.subprocess.Process] = set()   # every kubectl not yet reaped
        self.lost = 0                             # kubectls that ended under a connection

    def _hold(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def start_spares(self) -> None:
        for _ in range(SPARES):
            self._hold(self._spare())

    async def _spare(self) -> None:
        """Start a kubectl and put it in ``ready`` once it listens; retried until one does."""
        while True:
            self._prune()
            proc = await asyncio.create_subprocess_exec(
                "kubectl", "port-forward", *self.kubectl_args, f":{self.remote}",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL)
            self.procs.add(proc)
            errors = self._hold(_last_line(proc.stderr))
            port = await _port(proc.stdout)
            if port is not None:
                self._hold(_drain(proc.stdout))
                await self.ready.put(Kubectl(proc, port, errors))
                return
            await proc.wait()
            log(f"kubectl port-forward did not start (exit {proc.returncode}: "
                f"{await errors or 'no message'}); trying again")
            await asyncio.sleep(1.0)

    async def _take(self) -> Kubectl | None:
        """A ready kubectl that is still running (another is started in its place)."""
        deadline = time.monotonic() + self.wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                kubectl = await asyncio.wait_for(self.ready.get(), left)
            except asyncio.TimeoutError:
                break
            self._hold(self._spare())
            if kubectl.proc.returncode is None:
                return kubectl
        return None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Relay one client connection. One whose kubectl ended before any byte came back is
        sent again through the next: nothing reached the server then (TLS answers first)."""
        self.tasks.add(asyncio.current_task())
        link = _Link(writer)
        sending = self._hold(link.send(reader))
        kubectl = None
        try:
            for _ in range(RESENDS + 1):
                kubectl = await self._take()
                if kubectl is None:
                    log(f"no kubectl port-forward within {self.wait:g} s: connection closed")
                    break
                try:
                    up_reader, up_writer = await asyncio.open_connection("127.0.0.1",
                                                                         kubectl.port)
                except OSError:
                    self._retire(kubectl)
                    continue
                link.attach(up_writer)
                if await link.receive(up_reader) or not await kubectl.ended(3.0):
                    break
                self.lost += 1
                log(f"kubectl port-forward ended before its connection was answered (exit "
                    f"{kubectl.proc.returncode}: {await kubectl.errors or 'no message'}); "
                    "sent again")
                self._retire(kubectl)
        except asyncio.CancelledError:
            # stop() cancels it; ending as cancelled would make asyncio 3.11's own done
            # callback for a server's connection task (streams.py, connection_made:
            # task.exception()) raise CancelledError into the loop's error log.
            pass
        finally:
            sending.cancel()
            link.close()
            if kubectl is not None:
                self._retire(kubectl)
            self.tasks.discard(asyncio.current_task())

    def _retire(self, kubectl: Kubectl) -> None:
        kubectl.stop()

    def _prune(self) -> None:
        """Forget the kubectls that have ended and whose output has been read to its end."""
        self.procs -= {proc for proc in self.procs if proc.returncode is not None
                       and proc.stdout.at_eof() and proc.stderr.at_eof()}

    async def stop(self) -> None:
        """Every kubectl it started (the ones starting, waiting ready and ending included)
        ended and reaped, its pipes read to their end, before the event loop closes: a
        subprocess transport still open then fails in its finalizer ("Event loop is
        closed")."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)   # no reader holds a pipe now
        procs = list(self.procs)
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.communicate(), 5)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.communicate()


async def _port(stdout: asyncio.StreamReader) -> int | None:
    """kubectl's port, from its first line (None if it ends first)."""
    while line := await stdout.readline():
        if match := FORWARDING.match(line):
            return int(match[1])
    return None


async def _drain(stdout: asyncio.StreamReader) -> None:
    while await stdout.readline():      # a line per connection; unread, kubectl would block
        pass


async def _last_line(stderr: asyncio.StreamReader) -> str:
    last = ""
    while line := await stderr.readline():
        last = line.decode(errors="replace").strip()[:300] or last
    return last


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
    forward.start_spares()
    log(f"listening on {host}:{port}, forwarding to port {forward.remote} of "
        f"{forward.kubectl_args[-1]}, a kubectl port-forward per connection")
    await done.wait()
    server.close()
    await forward.stop()


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
