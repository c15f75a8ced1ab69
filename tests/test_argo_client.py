"""submit, submit --from-template, publish and --watch against a loopback HTTP server.

The server is a real ``http.server`` in a thread that records what it receives (method,
path, Authorization header, body kind, parameters) and answers like the Argo Server.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from workflows import argo as argo_module
from workflows.argo import ArgoError, ArgoServer
from workflows.cli import main

REPO = Path(__file__).resolve().parent.parent
TOKEN = "Bearer test-token-123"


class FakeArgo:
    """Records requests; ``phases`` is the sequence of workflow phases GET returns."""

    def __init__(self):
        self.requests: list[dict] = []
        self.templates: dict[str, dict] = {}
        self.phases = ["Running", "Succeeded"]
        self.polls = 0
        self.failures: list[int] = []   # codes the next GETs of a workflow answer first
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                record = {"method": self.command, "path": self.path,
                          "auth": self.headers.get("Authorization"), "body": body}
                fake.requests.append(record)
                code, reply = fake.answer(record)
                self._reply(code, reply)

            do_GET = do_POST = do_PUT = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, r: dict) -> tuple[int, dict]:
        parts = r["path"].strip("/").split("/")
        if r["auth"] != TOKEN:
            return 401, {"message": "token not valid"}
        if parts[:3] == ["api", "v1", "workflows"] and r["method"] == "POST":
            if parts[-1] == "submit":
                return 200, {"metadata": {"name": "from-template-abc"}, "spec": {}}
            wf = json.loads(json.dumps(r["body"]["workflow"]))   # Argo returns it, named
            wf["metadata"]["name"] = wf["metadata"]["generateName"] + "xyz12"
            return 200, wf
        if parts[:3] == ["api", "v1", "workflows"] and r["method"] == "GET" and self.failures:
            return self.failures.pop(0), {"message": "dial tcp 10.96.0.1:443: connect: "
                                                     "connection refused"}
        if parts[:3] == ["api", "v1", "workflows"] and r["method"] == "GET":
            phase = self.phases[min(self.polls, len(self.phases) - 1)]
            self.polls += 1
            return 200, {"metadata": {"name": parts[-1]}, "spec": {},
                         "status": {"phase": phase, "nodes": {
                "n1": {"id": "n1", "name": "wf.download", "displayName": "download",
                       "type": "Pod", "phase": "Succeeded"},
                "n2": {"id": "n2", "name": "wf.train", "displayName": "train", "type": "Pod",
                       "phase": phase}}}}
        if parts[:3] == ["api", "v1", "workflow-templates"]:
            name = parts[4] if len(parts) > 4 else r["body"]["template"]["metadata"]["name"]
            if r["method"] == "POST":
                if name in self.templates:
                    return 409, {"message": "already exists"}
                self.templates[name] = json.loads(json.dumps(r["body"]["template"]))
                self.templates[name]["metadata"]["resourceVersion"] = "1"
                return 200, self.templates[name]
            if r["method"] == "GET":
                return 200, self.templates[name]
            if r["method"] == "PUT":
                sent = r["body"]["template"]["metadata"].get("resourceVersion")
                if sent != self.templates[name]["metadata"]["resourceVersion"]:
                    return 409, {"message": "conflict"}
                self.templates[name] = json.loads(json.dumps(r["body"]["template"]))
                self.templates[name]["metadata"]["resourceVersion"] = str(int(sent) + 1)
                return 200, self.templates[name]
        return 404, {"message": "not found"}


@pytest.fixture
def argo():
    fake = FakeArgo()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def _env(argo: FakeArgo, **extra) -> dict:
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARGO_")}
    env.update({"ARGO_SERVER": argo.url, "ARGO_TOKEN": TOKEN, "ARGO_NAMESPACE": "ml",
                "ARGO_BASE_HREF": "", **extra})
    return env


def _cli(argo: FakeArgo, *args, **extra) -> subprocess.CompletedProcess:
    """The real command line in a child process (slow: used once)."""
    return subprocess.run([sys.executable, "workflows/unet.py", *args], cwd=REPO,
                          env=_env(argo, **extra), capture_output=True, text=True, timeout=60)


@pytest.fixture
def cli(argo, monkeypatch, capsys):
    """The same command line in this process, with the argo CLI's environment set."""
    def run(*args, **extra):
        for key, value in _env(argo, **extra).items():
            if key.startswith("ARGO_"):
                monkeypatch.setenv(key, value)
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)
    return run


@pytest.mark.slow
def test_submit_creates_workflow_and_prints_link(argo):
    proc = _cli(argo, "submit", "-p", "train.max_epochs=5")
    assert proc.returncode == 0, proc.stderr
    name, link = proc.stdout.split()
    assert name == "unet2d-brats-xyz12"
    assert link == f"{argo.url}/workflows/ml/{name}"
    (req,) = argo.requests
    assert (req["method"], req["path"], req["auth"]) == ("POST", "/api/v1/workflows/ml", TOKEN)
    wf = req["body"]["workflow"]
    assert wf["kind"] == "Workflow"
    params = {p["name"]: p["value"] for p in wf["spec"]["arguments"]["parameters"]}
    assert params["max-epochs"] == "5"


def test_submit_from_template_sends_parameters(argo, cli):
    proc = cli( "submit", "--from-template", "--profile", "cuda_1gpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "from-template-abc"
    (req,) = argo.requests
    assert req["path"] == "/api/v1/workflows/ml/submit"
    body = req["body"]
    assert (body["resourceKind"], body["resourceName"]) == ("WorkflowTemplate", "unet2d-brats")
    assert "devices=1" in body["submitOptions"]["parameters"]
    assert "workflow" not in body


def test_publish_creates_then_updates_on_409(argo, cli):
    first = cli("publish")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("created WorkflowTemplate ml/unet2d-brats")
    second = cli("publish", "-p", "train.max_epochs=3")
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("updated WorkflowTemplate ml/unet2d-brats")
    methods = [(r["method"], r["path"]) for r in argo.requests]
    assert methods == [("POST", "/api/v1/workflow-templates/ml"),
                       ("POST", "/api/v1/workflow-templates/ml"),
                       ("GET", "/api/v1/workflow-templates/ml/unet2d-brats"),
                       ("PUT", "/api/v1/workflow-templates/ml/unet2d-brats")]
    put = argo.requests[-1]["body"]["template"]
    assert put["kind"] == "WorkflowTemplate" and put["metadata"]["resourceVersion"] == "1"
    stored = argo.templates["unet2d-brats"]["spec"]["arguments"]["parameters"]
    assert {p["name"]: p["value"] for p in stored}["max-epochs"] == "3"


@pytest.mark.parametrize("final,code", [("Succeeded", 0), ("Failed", 1), ("Error", 1)])
def test_watch_exit_status_follows_the_workflow(argo, cli, final, code):
    argo.phases = ["Pending", "Running", final]
    proc = cli("submit", "--watch", "--poll", "0.01")
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.strip().endswith(f"unet2d-brats-xyz12: {final}")
    assert f"train: {final}" in proc.stderr
    gets = [r for r in argo.requests if r["method"] == "GET"]
    assert len(gets) == 3 and gets[0]["path"] == "/api/v1/workflows/ml/unet2d-brats-xyz12"


def test_watch_rides_out_a_server_that_cannot_reach_its_api_server(argo, cli):
    """While the API server behind it restarts, Argo's server answers 500: the watch says
    so once and goes on; a refusal (4xx) or an outage past WATCH_OUTAGE_S still ends it."""
    argo.phases, argo.failures = ["Running", "Succeeded"], [500, 500, 503]
    proc = cli("submit", "--watch", "--poll", "0.01")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("still watching") == 1 and "HTTP 500" in proc.stderr
    assert proc.stdout.strip().endswith("unet2d-brats-xyz12: Succeeded")
    argo.polls, argo.failures = 0, [404]
    proc = cli("submit", "--watch", "--poll", "0.01")
    assert proc.returncode == 2 and "HTTP 404" in proc.stderr
    assert "still watching" not in proc.stderr


def test_a_watch_gives_up_after_its_outage_bound(argo, cli, monkeypatch):
    monkeypatch.setattr(argo_module, "WATCH_OUTAGE_S", 0.2)
    argo.failures = [500] * 1000
    started = time.monotonic()
    proc = cli("submit", "--watch", "--poll", "0.01")
    assert proc.returncode == 2 and "HTTP 500" in proc.stderr.splitlines()[-1]
    assert 0.2 <= time.monotonic() - started < 30


def test_refused_token_is_one_line_and_not_echoed(argo, cli):
    proc = cli("submit", ARGO_TOKEN="Bearer wrong-secret-token")
    assert proc.returncode == 2
    assert "HTTP 401" in proc.stderr and "Traceback" not in proc.stderr
    assert "wrong-secret-token" not in proc.stderr + proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1


def test_env_conventions():
    server = ArgoServer.from_env({"ARGO_SERVER": "argo.example:2746", "ARGO_TOKEN": "abc",
                                  "ARGO_BASE_HREF": "/argo/", "ARGO_NAMESPACE": "team",
                                  "ARGO_INSECURE_SKIP_VERIFY": "true"})
    assert server.base_url == "https://argo.example:2746/argo"
    assert server.token == "Bearer abc" and server.verify_tls is False
    assert server.ui_link("wf-1") == "https://argo.example:2746/argo/workflows/team/wf-1"
    plain = ArgoServer.from_env({"ARGO_SERVER": "localhost:2746", "ARGO_SECURE": "false"})
    assert plain.base_url == "http://localhost:2746" and plain.namespace == "argo"
    with pytest.raises(ArgoError, match="ARGO_SERVER is not set"):
        ArgoServer.from_env({})


def test_base_href_prefixes_api_calls(argo):
    server = ArgoServer.from_env({"ARGO_SERVER": argo.url + "/", "ARGO_TOKEN": TOKEN,
                                  "ARGO_BASE_HREF": "/argo/"})
    with pytest.raises(ArgoError, match="HTTP 404"):
        server.get_workflow("x")
    assert argo.requests[-1]["path"] == "/argo/api/v1/workflows/argo/x"


def test_a_server_that_never_answers_times_out_in_one_line():
    """Hera's service sets no timeout of its own; ours bounds every request."""
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)          # accepts the connection, never replies
    try:
        server = ArgoServer(base_url=f"http://127.0.0.1:{listener.getsockname()[1]}",
                            token=TOKEN, timeout=0.5)
        with pytest.raises(ArgoError, match=r"cannot reach it \(ReadTimeout\)") as info:
            server.get_workflow("x")
        assert "test-token" not in str(info.value)
    finally:
        listener.close()


def test_a_reply_that_is_not_a_workflow_is_one_line(argo):
    argo.answer = lambda record: (200, {"unexpected": True})
    server = ArgoServer.from_env(_env(argo))
    with pytest.raises(ArgoError, match="get workflow: unexpected reply"):
        server.get_workflow("x")
