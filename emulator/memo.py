"""Memoization like Argo's, with the cache kept in the artifact bucket.

Argo stores a memoized node's outputs in the ConfigMap ``memoize.cache.configMap.name``
under the resolved ``memoize.key`` (which must match ``^[a-zA-Z0-9][-a-zA-Z0-9]*$``); a
later node with the same key, younger than ``maxAge`` (default 30 days), is not run and
reuses those outputs. Here the entry is an object
``<MEMO_PREFIX>/<configMap>/<key>.json`` in the artifact bucket.

As in Argo (``operator.go``: a hit becomes a Succeeded node with the cached outputs; nothing
checks that the artifacts still exist), an entry whose artifacts were deleted is still a
hit: the consumer's input then fails to load (``artifact <name> failed to load``), exactly
where it fails on a cluster.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone

from steps import storage
from emulator.errors import LocalRunError
from emulator.expr import substitute
from emulator.results import ArtifactRef
from emulator.spec import duration_seconds

MEMO_PREFIX = "argo-local-memoize"
KEY_RE = re.compile(r"^[a-zA-Z0-9][-a-zA-Z0-9]*$")
DEFAULT_MAX_AGE_S = 30 * 24 * 3600


@dataclass(frozen=True)
class Memo:
    """A template's resolved ``memoize``: where its entry lives and how long it is fresh."""
    configmap: str
    key: str
    max_age: float

    @classmethod
    def of(cls, template: dict, template_name: str, scope: dict) -> "Memo | None":
        spec = template.get("memoize")
        if not spec:
            return None
        where = f"spec.templates[{template_name}].memoize"
        key = check_key(substitute(spec["key"], scope, f"{where}.key"), f"{where}.key")
        max_age = duration_seconds(spec["maxAge"], f"{where}.maxAge") if spec.get("maxAge") \
            else DEFAULT_MAX_AGE_S
        return cls(spec["cache"]["configMap"]["name"], key, max_age)


def _uri(bucket: str, configmap: str, key: str) -> str:
    return f"s3://{bucket}/{MEMO_PREFIX}/{configmap}/{key}.json"


def check_key(key: str, where: str) -> str:
    if not KEY_RE.match(key):
        raise LocalRunError(f"{where}: memoization key {key!r} is not valid for Argo's "
                            "ConfigMap cache (^[a-zA-Z0-9][-a-zA-Z0-9]*$; hash long inputs)")
    return key


def load(bucket: str, configmap: str, key: str, max_age_s: float) -> dict | None:
    """The cached outputs for ``key`` when fresh, else None (a miss)."""
    uri = _uri(bucket, configmap, key)
    if not storage.exists(uri):
        return None
    try:
        entry = json.loads(storage.get_bytes(uri))
        created = datetime.fromisoformat(entry["creationTimestamp"])
        refs = [ArtifactRef.from_dict(a) for a in entry["outputs"]["artifacts"]]
    except (ValueError, KeyError, TypeError):
        return None
    if (datetime.now(timezone.utc) - created).total_seconds() > max_age_s:
        return None
    entry["lastHitTimestamp"] = datetime.now(timezone.utc).isoformat()
    storage.put_bytes(json.dumps(entry, indent=1).encode(), uri)
    return {"node_id": entry.get("nodeID", ""), "parameters": entry["outputs"]["parameters"],
            "artifacts": {ref.name: ref for ref in refs}}


def save(bucket: str, configmap: str, key: str, node_id: str, parameters: dict[str, str],
         artifacts: dict[str, ArtifactRef]) -> str:
    now = datetime.now(timezone.utc).isoformat()
    entry = {"nodeID": node_id, "creationTimestamp": now, "lastHitTimestamp": now,
             "outputs": {"parameters": parameters,
                         "artifacts": [vars(ref) for ref in artifacts.values()]}}
    uri = _uri(bucket, configmap, key)
    storage.put_bytes(json.dumps(entry, indent=1).encode(), uri)
    return uri
