"""Submit, publish and watch on the Argo Server through Hera's ``WorkflowsService``.

What Hera lacks, and this module adds: the ``argo`` CLI's environment (Hera's own config
is set in code, not read from ``ARGO_*``), a timeout on every request (Hera sets none, so
a silent server would hang ``submit``), publish as create-or-update, the status watch,
and one-line errors.

Environment: ``ARGO_SERVER`` (``host:port``, or a URL with its scheme), ``ARGO_SECURE``
(``false`` means plain http when ARGO_SERVER has no scheme), ``ARGO_TOKEN`` (the
Authorization value, e.g. ``Bearer ...``; a bare token gets ``Bearer``),
``ARGO_NAMESPACE`` (default ``argo``), ``ARGO_INSECURE_SKIP_VERIFY`` and
``ARGO_BASE_HREF`` (the path prefix of both the API and the UI). A server whose certificate
your own CA signed: ``REQUESTS_CA_BUNDLE`` names that CA's file (requests reads it; the argo
CLI, in Go, reads ``SSL_CERT_FILE``).

Errors are one line (:class:`ArgoError`) naming the server, the call and the HTTP status;
the token is never printed.
"""
from __future__ import annotations

import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import requests
from hera.exceptions import AlreadyExists, HeraException
from hera.workflows import Workflow, WorkflowTemplate
from hera.workflows import models as m
from hera.workflows.service import WorkflowsService

from steps import uris
from steps.errors import StepError

DONE = ("Succeeded", "Failed", "Error")
WATCH_OUTAGE_S = 300.0   # a watch outlives an API server's restart (tests/test_chaos.py)
_HERA_MESSAGE = re.compile(r"status code (\d+) with message: `(.*)`", re.DOTALL)


class ArgoError(StepError):
    """The Argo Server refused a request or could not be reached. ``transient``: it could
    not be reached, or answered 5xx (it could not reach the API server behind it, say)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class _TimedSession(requests.Session):
    """A session whose every request has a timeout."""

    def __init__(self, timeout: float):
        super().__init__()
        self.timeout = timeout

    def request(self, method, url, **kwargs):
        kwargs.setdefault("timeout", self.timeout)
        return super().request(method, url, **kwargs)


def _plain(model: Any) -> dict:
    """A Hera model as the JSON dict the server sent."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


@dataclass
class ArgoServer:
    base_url: str          # scheme://host:port/base-href (no trailing slash)
    namespace: str = "argo"
    token: str = ""
    verify_tls: bool = True
    ca_file: str = ""       # the CA that signed the server's certificate; "": the system's
    timeout: float = 30.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ArgoServer":
        env = os.environ if env is None else env
        server = (env.get("ARGO_SERVER") or "").strip()
        if not server:
            raise ArgoError("ARGO_SERVER is not set (host:port of the Argo Server, "
                            "e.g. localhost:2746)")
        if "://" not in server:
            secure = env.get("ARGO_SECURE", "true").strip().lower() not in ("false", "0", "no")
            server = f"{'https' if secure else 'http'}://{server}"
        uris.refuse_credentials(server, "ARGO_SERVER", "give the token in ARGO_TOKEN")
        base_href = (env.get("ARGO_BASE_HREF") or "").strip().strip("/")
        base = server.rstrip("/") + (f"/{base_href}" if base_href else "")
        token = (env.get("ARGO_TOKEN") or "").strip()
        if token and not token.lower().startswith(("bearer ", "basic ")):
            token = f"Bearer {token}"
        return cls(base_url=base, namespace=(env.get("ARGO_NAMESPACE") or "argo").strip(),
                   token=token, verify_tls=not _truthy(env.get("ARGO_INSECURE_SKIP_VERIFY")))

    @property
    def verify(self) -> bool | str:
        """requests' ``verify``: False, the CA file, or True (the system's CAs, or
        ``REQUESTS_CA_BUNDLE``)."""
        return (self.ca_file or True) if self.verify_tls else False

    def ui_link(self, name: str) -> str:
        return f"{self.base_url}/workflows/{self.namespace}/{name}"

    def service(self) -> WorkflowsService:
        # The trailing slash keeps ARGO_BASE_HREF: Hera joins "api/v1/..." onto the host.
        return WorkflowsService(host=self.base_url + "/", token=self.token or None,
                                verify_ssl=self.verify, namespace=self.namespace,
                                session=_TimedSession(self.timeout))

    def call(self, what: str, method: Callable[..., Any], *args, **kwargs) -> Any:
        """One service call; a refusal or an unreachable server becomes an ArgoError."""
        try:
            with warnings.catch_warnings():   # ARGO_INSECURE_SKIP_VERIFY asked for it
                warnings.simplefilter("ignore")
                return method(*args, **kwargs)
        except AlreadyExists:
            raise
        except HeraException as exc:
            found = _HERA_MESSAGE.search(str(exc))
            detail = f"HTTP {found.group(1)} {found.group(2)}" if found else str(exc)
            raise ArgoError(f"argo server {self.base_url}: {what} failed: {detail}",
                            transient=bool(found) and found.group(1).startswith("5")) \
                from None
        except requests.RequestException as exc:
            raise ArgoError(f"argo server {self.base_url}: cannot reach it "
                            f"({type(exc).__name__})", transient=True) from None
        except ValueError as exc:    # pydantic: the reply is not the object Argo returns
            raise ArgoError(f"argo server {self.base_url}: {what}: unexpected reply "
                            f"({str(exc).splitlines()[0][:120]})") from None

    # --- API calls -----------------------------------------------------------------------
    def create_workflow(self, workflow: dict) -> dict:
        request = m.WorkflowCreateRequest(namespace=self.namespace,
                                          workflow=Workflow.from_dict(workflow).build())
        try:
            return _plain(self.call("create workflow", self.service().create_workflow, request))
        except AlreadyExists:
            raise ArgoError(f"argo server {self.base_url}: workflow already exists") from None

    def submit_from_template(self, template: str, parameters: list[str]) -> dict:
        request = m.WorkflowSubmitRequest(
            namespace=self.namespace, resource_kind="WorkflowTemplate", resource_name=template,
            submit_options=m.SubmitOpts(parameters=parameters))
        return _plain(self.call("submit", self.service().submit_workflow, request))

    def publish_template(self, template: dict) -> tuple[str, dict]:
        """Create the WorkflowTemplate, or update it in place when it exists (409)."""
        service, name = self.service(), template["metadata"]["name"]
        model = WorkflowTemplate.from_dict(template).build()
        try:
            created = self.call("create template", service.create_workflow_template,
                                m.WorkflowTemplateCreateRequest(namespace=self.namespace,
                                                                template=model))
            return "created", _plain(created)
        except AlreadyExists:
            pass
        current = self.call("get template", service.get_workflow_template, name)
        model.metadata.resource_version = current.metadata.resource_version
        try:
            updated = self.call("update template", service.update_workflow_template, name,
                                m.WorkflowTemplateUpdateRequest(
                                    name=name, namespace=self.namespace, template=model))
        except AlreadyExists:
            raise ArgoError(f"argo server {self.base_url}: template {name} changed while "
                            "updating it; publish again") from None
        return "updated", _plain(updated)

    def get_workflow(self, name: str) -> dict:
        return _plain(self.call("get workflow", self.service().get_workflow, name))

    def watch(self, name: str, poll: float = 5.0, timeout: float | None = None,
              out=None) -> str:
        """Poll until the workflow ends; print each node's phase change; return the phase.
        A poll that fails transiently (the server unreachable or answering 5xx, as while
        the API server behind it restarts) is said once and repeated, for at most
        ``WATCH_OUTAGE_S`` in a row: the workflow runs on without the watch."""
        out = out or sys.stderr
        seen: dict[str, str] = {}
        start = time.monotonic()
        while True:
            status = (self._poll(name, poll, out) or {}).get("status") or {}
            for node in sorted((status.get("nodes") or {}).values(),
                               key=lambda n: n.get("startedAt") or ""):
                if node.get("type") not in ("Pod", "Retry", "Skipped"):
                    continue
                label, phase = node.get("displayName", node.get("id")), node.get("phase", "")
                if seen.get(label) != phase:
                    seen[label] = phase
                    extra = f" ({node['message']})" if node.get("message") else ""
                    print(f"{label}: {phase}{extra}", file=out, flush=True)
            phase = status.get("phase") or ""
            if phase in DONE:
                return phase
            if timeout is not None and time.monotonic() - start > timeout:
                raise ArgoError(f"workflow {name}: still {phase or 'Pending'} after "
                                f"{timeout:g} s")
            time.sleep(poll)

    def _poll(self, name: str, every: float, out) -> dict:
        """get_workflow, repeated through a transient outage of at most WATCH_OUTAGE_S."""
        began = None
        while True:
            try:
                return self.get_workflow(name)
            except ArgoError as exc:
                now = time.monotonic()
                if not exc.transient or (began is not None and now - began > WATCH_OUTAGE_S):
                    raise
                if began is None:
                    began = now
                    print(f"{exc}; still watching (up to {WATCH_OUTAGE_S:g} s)", file=out,
                          flush=True)
            time.sleep(every)
