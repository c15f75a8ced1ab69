"""The one URI parser: every flag or config value that names a place goes through here.

A caller says which kinds it accepts; the same text is read the same way by every step, and
a refusal is one line naming the flag, the (redacted) URI and what is wrong.

=============  ================================================  ===========================
kind           forms                                             parsed into
=============  ================================================  ===========================
``s3``         ``s3://bucket/key``                               ``bucket``, ``key``
``http``       ``https://host/path``, ``http://host/path``       ``text``
``file``       ``file:///abs``, ``file://localhost/abs``,        ``path``
               ``file://relative/path``
``path``       a plain local path, no scheme (``/data/ck``)      ``path``
``synthetic``  ``synthetic://?query``                            ``query``
=============  ================================================  ===========================
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from steps.errors import StepError

KINDS = ("s3", "http", "file", "path", "synthetic")
# What each kind of place accepts (the flags and the config keys that feed them).
SOURCE_KINDS = ("s3", "http", "file", "synthetic")      # download --source, download.source
CHECKPOINT_KINDS = ("s3", "file", "path")               # train --checkpoint-uri, --resume-from
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,61}[a-z0-9]$")
MAX_KEY_BYTES = 1024        # S3's limit on an object key, in UTF-8 bytes
SYNTHETIC_DEFAULTS = {"cases": 10, "shape": "240x240x155", "seed": 0, "test": 0}
MIN_SHAPE = (24, 24, 12)    # the smallest synthetic case (steps.synthetic)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SECRET_QUERY = re.compile(r"sig|token|key|credential|secret|pass|pwd|auth", re.IGNORECASE)
# scheme://userinfo@ : the authority up to its last '@'. The scheme's length is bounded so
# that a long run of letters costs linear time, not quadratic backtracking.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^/?#\s]*@")
# scheme://user:password@ with a '/', '?' or '#' left unescaped in the password, which ends
# the authority for urlsplit (and for _USERINFO) before its '@': a user part and a ':' that
# does not start a port (digits, then the path, query, fragment or the end), searched for in
# a run of text before its last '@' (_loose_userinfo), so that the cost stays linear.
_USER_COLON = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s@:/?#]*:(?!\d*(?:[/?#]|$))")
_RUN = re.compile(r"\S+")


@dataclass(frozen=True)
class Uri:
    kind: str
    text: str
    bucket: str = ""
    key: str = ""
    path: Path | None = None
    query: str = ""

    @property
    def name(self) -> str:
        """Base name of the object or file the URI points at ('' for synthetic)."""
        if self.path is not None:
            return self.path.name
        if self.kind == "synthetic":
            return ""
        return PurePosixPath(unquote(urlsplit(self.text).path)).name


def redact(text: str) -> str:
    """``text`` safe to print, whatever it is: the userinfo of any ``scheme://user:pw@``
    becomes ``***@``, and secret-looking query values ``***``. The one redaction: every URL
    a step, the CLI or an error line prints goes through it."""
    text = _RUN.sub(_loose_userinfo, _USERINFO.sub(r"\1***@", str(text)))
    head, mark, rest = text.partition("?")
    query, hash_, fragment = rest.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(_SECRET_QUERY.search(k) for k, _ in pairs):
        return text               # unchanged, byte for byte
    query = "&".join(f"{k}=***" if _SECRET_QUERY.search(k) else f"{k}={v}" for k, v in pairs)
    return head + mark + query + hash_ + fragment


def has_credentials(text: str) -> bool:
    """Whether ``text`` holds a URL with ``user:password@`` (or a bare ``token@``)."""
    text = str(text)
    return _USERINFO.search(text) is not None or _RUN.sub(_loose_userinfo, text) != text


def _loose_userinfo(run: re.Match) -> str:
    """A run of text with ``scheme://user:`` before its last '@' redacted up to that '@'."""
    text = run.group(0)
    head = text[:text.rfind("@")]
    found = _USER_COLON.search(head) if head else None
    return text if found is None else text[:found.end(1)] + "***" + text[len(head):]


def refuse_credentials(text: str, flag: str, instead: str) -> None:
    """A URL with ``user:password@`` (or a bare ``token@``) is refused where a Secret or an
    environment variable belongs (``instead`` says which): it would be echoed, logged and
    written into the compiled workflow."""
    if has_credentials(text):
        raise StepError(f"{flag} '{redact(text)}': credentials in a URL are not accepted "
                        f"({instead})")


def stable(text: str) -> str:
    """The URI without query and fragment: what names the same object across runs."""
    return urlunsplit(urlsplit(text)._replace(query="", fragment=""))


def parse(text: str, flag: str, kinds: tuple[str, ...]) -> Uri:
    """Parse ``text`` given to ``flag``, accepting only ``kinds`` (a subset of KINDS)."""
    if not isinstance(text, str):
        raise StepError(f"{flag}: {text!r} is not a URI")
    text = text.strip()
    shown = redact(text)
    if _CONTROL.search(text):
        raise StepError(f"{flag} {shown!r}: control characters are not allowed in a URI")
    refuse_credentials(text, flag, "S3 keys come from the AWS_* variables, on a cluster "
                                   "from the credentials Secret")
    match = _SCHEME.match(text)
    scheme = match.group(1).lower() if match and "://" in text else ""
    kind = "http" if scheme == "https" else (scheme or "path")
    if kind not in kinds:
        accepted = ", ".join("a local path" if k == "path" else
                             ("https://, http://" if k == "http" else f"{k}://") for k in kinds)
        what = f"unsupported scheme '{scheme}'" if scheme else "a plain path is not accepted"
        raise StepError(f"{flag} '{shown}': {what} (use {accepted})")
    if kind == "path":
        if not text:
            raise StepError(f"{flag}: empty path")
        return Uri("path", text, path=Path(text))
    try:
        parts = urlsplit(text)
    except ValueError as exc:       # e.g. an unclosed IPv6 bracket
        raise StepError(f"{flag} '{shown}': not a valid URI ({exc})") from None
    if kind == "s3":
        return _s3(text, flag, shown)
    if kind == "http":
        if not parts.netloc or not parts.path.strip("/"):
            raise StepError(f"{flag} '{shown}': an http(s) URI needs a host and a file path")
        return Uri("http", text)
    if kind == "file":
        raw = parts.path if parts.netloc in ("", "localhost") else parts.netloc + parts.path
        if not raw:
            raise StepError(f"{flag} '{shown}': a file URI needs a path (file:///data/x.tar)")
        return Uri("file", text, path=Path(unquote(raw)))
    if parts.netloc or parts.path.strip("/"):
        raise StepError(f"{flag} '{shown}': write synthetic://?cases=N&shape=HxWxD&seed=S")
    synthetic_params(text, parts.query, flag)        # refused here, at render or in the step
    return Uri("synthetic", text, query=parts.query)


def synthetic_params(uri: str, query: str, flag: str) -> dict:
    """cases (>= 1), shape (HxWxD, at least MIN_SHAPE), seed (>= 0) and test (>= 0) of a
    ``synthetic://`` query; an unknown, repeated or malformed parameter is a StepError. The
    size limits a step applies to them are the step's (steps.download)."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise StepError(f"{flag} '{uri}': malformed query '{query}'") from None
    params, seen = dict(SYNTHETIC_DEFAULTS), set()
    for key, value in pairs:
        if key not in SYNTHETIC_DEFAULTS:
            raise StepError(f"{flag} '{uri}': unknown parameter '{key}' (known: "
                            f"{', '.join(SYNTHETIC_DEFAULTS)})")
        if key in seen:
            raise StepError(f"{flag} '{uri}': parameter '{key}' is given twice")
        seen.add(key)
        params[key] = value
    return {"cases": _int_param(uri, flag, "cases", params["cases"], 1),
            "seed": _int_param(uri, flag, "seed", params["seed"], 0),
            "test": _int_param(uri, flag, "test", params["test"], 0),
            "shape": _shape_param(uri, flag, str(params["shape"]))}


def _int_param(uri: str, flag: str, key: str, value, minimum: int) -> int:
    try:
        number = int(str(value))
    except ValueError:
        raise StepError(f"{flag} '{uri}': {key}='{value}' is not an integer") from None
    if number < minimum:
        raise StepError(f"{flag} '{uri}': {key}={number} must be at least {minimum}")
    return number


def _shape_param(uri: str, flag: str, value: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", value.strip().lower())
    if not match:
        raise StepError(f"{flag} '{uri}': shape='{value}' is not HxWxD (e.g. 240x240x155)")
    shape = tuple(int(g) for g in match.groups())
    if any(s < m for s, m in zip(shape, MIN_SHAPE)):
        raise StepError(f"{flag} '{uri}': shape={value} is smaller than the minimum "
                        f"{'x'.join(map(str, MIN_SHAPE))}")
    return shape  # type: ignore[return-value]


def _s3(text: str, flag: str, shown: str) -> Uri:
    bucket, _, key = text[len("s3://"):].partition("/")
    if not BUCKET.match(bucket):
        raise StepError(f"{flag} '{shown}': bucket name '{bucket}' is not valid "
                        "(3-63 lower-case letters, digits, '.', '-')")
    if any(part in (".", "..") for part in key.split("/")):
        raise StepError(f"{flag} '{shown}': a key may not hold '.' or '..' segments")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise StepError(f"{flag} '{shown}': the key is {len(key.encode())} bytes, more than "
                        f"the {MAX_KEY_BYTES} S3 allows")
    return Uri("s3", text, bucket=bucket, key=key)
