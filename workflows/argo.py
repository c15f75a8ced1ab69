"""A small Argo Server REST client, configured the way the ``argo`` CLI is.

Environment: ``ARGO_SERVER`` (``host:port``, or a URL with its scheme), ``ARGO_SECURE``
(``false`` means plain http when ARGO_SERVER has no scheme), ``ARGO_TOKEN`` (the
Authorization value, e.g. ``Bearer ...``; a bare token gets ``Bearer``),
``ARGO_NAMESPACE`` (default ``argo``), ``ARGO_INSECURE_SKIP_VERIFY`` and
``ARGO_BASE_HREF`` (the path prefix of both the API and the UI).

Errors are one line (:class:`ArgoError`) naming the server, method and path; the token is
never printed.
"""
from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping

from steps.errors import StepError

DONE = ("Succeeded", "Failed", "Error")


class ArgoError(StepError):
    """The Argo Server refused a request or could not be reached."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class ArgoServer:
    base_url: str          # scheme://host:port/base-href (no trailing slash)
    namespace: str = "argo"
    token: str = ""
    verify_tls: bool = True
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
        base_href = (env.get("ARGO_BASE_HREF") or "").strip().strip("/")
        base = server.rstrip("/") + (f"/{base_href}" if base_href else "")
        token = (env.get("ARGO_TOKEN") or "").strip()
        if token and not token.lower().startswith(("bearer ", "basic ")):
            token = f"Bearer {token}"
        return cls(base_url=base, namespace=(env.get("ARGO_NAMESPACE") or "argo").strip(),
                   token=token, verify_tls=not _truthy(env.get("ARGO_INSECURE_SKIP_VERIFY")))

    def ui_link(self, name: str) -> str:
        return f"{self.base_url}/workflows/{self.namespace}/{name}"

    def request(self, method: str, path: str, body: Any | None = None) -> tuple[int, Any]:
        """Send one JSON request; return (status, decoded body). Non-2xx raise ArgoError,
        except 409 which is returned so callers can update instead."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", self.token)
        context = None
        if self.base_url.startswith("https") and not self.verify_tls:
            context = ssl._create_unverified_context()  # ARGO_INSECURE_SKIP_VERIFY asked for it
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=context) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as exc:
            payload = _decode(exc.read())
            if exc.code == 409:
                return 409, payload
            message = payload.get("message") if isinstance(payload, dict) else None
            raise ArgoError(f"argo server {self.base_url}: {method} {path} failed: HTTP "
                            f"{exc.code} {message or exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ArgoError(f"argo server {self.base_url}: cannot reach it ({reason})") from None

    # --- API calls -----------------------------------------------------------------------
    def create_workflow(self, workflow: dict) -> dict:
        status, body = self.request("POST", f"/api/v1/workflows/{self.namespace}",
                                    {"namespace": self.namespace, "workflow": workflow})
        if status == 409:
            raise ArgoError(f"argo server {self.base_url}: workflow already exists")
        return body

    def submit_from_template(self, template: str, parameters: list[str]) -> dict:
        status, body = self.request("POST", f"/api/v1/workflows/{self.namespace}/submit", {
            "namespace": self.namespace, "resourceKind": "WorkflowTemplate",
            "resourceName": template, "submitOptions": {"parameters": parameters}})
        return body

    def publish_template(self, template: dict) -> tuple[str, dict]:
        """Create the WorkflowTemplate, or update it in place when it exists (409)."""
        ns, name = self.namespace, template["metadata"]["name"]
        status, body = self.request("POST", f"/api/v1/workflow-templates/{ns}",
                                    {"namespace": ns, "template": template})
        if status != 409:
            return "created", body
        _, current = self.request("GET", f"/api/v1/workflow-templates/{ns}/{name}")
        updated = json.loads(json.dumps(template))
        updated["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        status, body = self.request("PUT", f"/api/v1/workflow-templates/{ns}/{name}",
                                    {"namespace": ns, "name": name, "template": updated})
        if status == 409:
            raise ArgoError(f"argo server {self.base_url}: template {name} changed while "
                            "updating it; publish again")
        return "updated", body

    def get_workflow(self, name: str) -> dict:
        return self.request("GET", f"/api/v1/workflows/{self.namespace}/{name}")[1]

    def watch(self, name: str, poll: float = 5.0, timeout: float | None = None,
              out=None) -> str:
        """Poll until the workflow ends; print each node's phase change; return the phase."""
        out = out or sys.stderr
        seen: dict[str, str] = {}
        start = time.monotonic()
        while True:
            status = (self.get_workflow(name) or {}).get("status") or {}
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


def _decode(raw: bytes) -> Any:
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return {"message": raw.decode(errors="replace")[:200]}
