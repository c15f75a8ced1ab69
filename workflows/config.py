"""The one configuration model: ``config/pipeline.yaml`` + a profile + ``-p key=value``.

Loading order: the file's base values, then the named profile (a partial mapping merged
into the base), then each ``-p`` override. The result is validated once; the first
unknown key or bad value becomes a :class:`ConfigError` whose message is one line naming
the key, e.g. ``config: train.fold: must be <= 4 (got 7)``.

Override keys are dotted paths (``train.batch_size=32``). A bare key (``batch_size=32``)
is accepted when exactly one section has it. Values stay text and the model
converts them (``true``, ``8``, ``1e-4``), so a tag like ``1.10`` stays ``1.10``.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, Sequence

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError, create_model, field_validator, model_validator)

from steps import params, storage, uris
from steps.errors import StepError, unsafe_characters
from workflows import durations

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "config" / "pipeline.yaml"
STAGES = ("download", "preprocess", "train", "convert")
# After convert, each optional, in this order: quantize (on the UI form as the 'quantize'
# parameter) and evaluate (whole volumes of the held-out fold, steps.evaluate).
OPTIONAL_STAGES = ("quantize", "evaluate")
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
_DURATION = r"^[0-9]+(s|m|h)$"
_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Config values reach the compiled YAML as data. Each kind has its own rule (the names of
# S3, Kubernetes and the OCI distribution spec), and no value at all may hold an Argo
# template ({{ }}) or a control character: see _check_values.
_BUCKET = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"           # S3 bucket naming rules
_KEY_PREFIX = r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$"      # S3 key segments, no leading /
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_DATA_KEY = r"^[-._a-zA-Z0-9]+$"                           # a Secret or ConfigMap key
_REGION = r"^[a-z]{2}(-[a-z]+)+-[0-9]+$"
_REPOSITORY = r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)+$"
_TAG = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
_LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
_TEMPLATE = re.compile(r"\{\{|\}\}")
# What marks a credential, by its variable's name or by its shape. A literal one in
# resources.extra_env would be written into the compiled YAML (_no_credentials refuses it);
# lint looks for the same in any compiled document.
SECRET_NAME = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|PRIVATE_KEY|API_KEY)",
                         re.IGNORECASE)
SECRET_PATTERNS = {
    "an AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "a private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "credentials in a URL": re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@{}]+:[^/\s@{}]+@"),
}


def _no_credentials(env: dict[str, str]) -> dict[str, str]:
    """``resources.extra_env`` as literal values may be: none named or shaped as a
    credential. The message names the variable, never its value."""
    for name, value in env.items():
        if SECRET_NAME.search(name):
            raise ValueError(f"must not name a credential ({name}: a literal value would be "
                             "written into the compiled workflow; give it through a Secret)")
        for what, pattern in SECRET_PATTERNS.items():
            if pattern.search(value) or (what == "credentials in a URL"
                                         and uris.has_credentials(value)):
                raise ValueError(f"must not hold a credential ({name} holds {what}, which "
                                 "would be written into the compiled workflow)")
    return env


def _no_dot_segments(value: str) -> str:
    if any(part in (".", "..") for part in value.split("/")):
        raise ValueError("a key prefix without '.' or '..' segments")
    return value


# S3 keys hold at most 1024 bytes (uris.MAX_KEY_BYTES); the pipeline appends up to 512 to a
# prefix (the workflow's and the pod's names, the artifact's files).
MAX_PREFIX_BYTES = uris.MAX_KEY_BYTES - 512
KeyPrefix = Annotated[str, Field(pattern=_KEY_PREFIX, max_length=MAX_PREFIX_BYTES),
                      AfterValidator(_no_dot_segments)]
EnvName = Annotated[str, Field(pattern=_ENV_NAME)]
LabelKey = Annotated[str, Field(pattern=_LABEL_KEY)]
LabelValue = Annotated[str, Field(pattern=_LABEL_VALUE)]


class ConfigError(StepError):
    """A bad config file, profile or override; the message is one line naming the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Pipeline(_Strict):
    model_name: str = Field("unet2d-brats", pattern=_NAME, max_length=40,
                            description="model name: workflow prefix, models/<model_name>/ key")
    stages: list[Literal["download", "preprocess", "train", "convert", "quantize",
                         "evaluate"]] = \
        list(STAGES)
    service_account: str = Field("unet-workflow", pattern=_NAME)
    run_as_user: int = Field(1000, ge=1, description="non-root uid for every step pod")
    folds: list[Annotated[int, Field(ge=0, le=params.N_FOLDS - 1)]] = Field(
        [], description="nnU-Net's cross-validation in one run: a train, convert and "
                        "evaluate per fold in parallel, then the folds' evaluations pooled "
                        "and their ensemble released (empty: one train on train.fold)")

    @field_validator("stages")
    @classmethod
    def _all_stages_in_order(cls, value: list[str]) -> list[str]:
        optional = tuple(value[len(STAGES):])
        if tuple(value[:len(STAGES)]) != STAGES or optional != tuple(
                s for s in OPTIONAL_STAGES if s in optional):
            raise ValueError(f"must be {list(STAGES)}, optionally followed by any of "
                             f"{list(OPTIONAL_STAGES)} (the DAG's stages in their order)")
        return value

    @field_validator("folds")
    @classmethod
    def _two_folds_or_none(cls, value: list[int]) -> list[int]:
        if len(value) == 1 or len(set(value)) != len(value):
            raise ValueError("must be empty or at least two different folds")
        return value


class Image(_Strict):
    repository: str = Field(pattern=_REPOSITORY, description="registry/path, lower case")
    tag: str = Field(pattern=_TAG)


class Images(_Strict):
    cpu: Image
    cuda: Image
    gaudi: Image
    pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"


class Storage(_Strict):
    artifact_repository_configmap: str = Field("artifact-repositories", pattern=_NAME)
    artifact_repository_key: str = Field("default-v1", pattern=_DATA_KEY)
    bucket: str = Field(storage.DEFAULT_BUCKET, pattern=_BUCKET)
    endpoint: str = Field("", pattern=r"^(https?://[A-Za-z0-9.-]+(:[0-9]+)?/?)?$",
                          description="S3 endpoint for the checkpoint store; empty: the "
                                      "settings ConfigMap's, else AWS")
    region: str = Field(storage.DEFAULT_REGION, pattern=_REGION)
    settings_configmap: str = Field("unet-storage", pattern=_NAME,
                                    description="ConfigMap (made by the overlay) whose key "
                                                "'endpoint' is the cluster's S3 endpoint")
    credentials_secret: str = Field("unet-s3-credentials", pattern=_NAME,
                                    description="optional Secret with the S3 keys; absent: "
                                                "the SDK's chain (IRSA)")
    access_key_key: str = Field("accessKey", pattern=_DATA_KEY)
    secret_key_key: str = Field("secretKey", pattern=_DATA_KEY)
    checkpoint_prefix: KeyPrefix = "checkpoints"
    models_prefix: KeyPrefix = "models"


class Memoize(_Strict):
    config_map: str = Field("unet-memoize-cache", pattern=_NAME)
    max_age: str = Field("720h", pattern=_DURATION)


class Retry(_Strict):
    """Argo waits ``backoff_duration * backoff_factor**n`` after failed attempt n, and only
    then evaluates the retry expression (operator.go ``processNodeRetries``: the backoff
    block comes before the retry policy and expression), so an input error (exit 2) also
    fails after the first wait, ``backoff_duration``. A cap only matters when a wait could
    pass it: one that never can is refused rather than compiled (issue 26)."""
    limit: int = Field(2, ge=0, le=10)
    backoff_duration: str = Field("30s", pattern=_DURATION)
    backoff_factor: int = Field(2, ge=1)
    backoff_cap: str | None = Field(None, pattern=_DURATION,
                                    description="longest wait between attempts; there is no "
                                                "overall deadline, each attempt has its step's "
                                                "timeout")

    @model_validator(mode="after")
    def _cap_can_apply(self) -> "Retry":
        if self.backoff_cap is None or self.limit == 0:
            return self
        longest = seconds(self.backoff_duration) * self.backoff_factor ** (self.limit - 1)
        if seconds(self.backoff_cap) >= longest:
            raise ValueError(f"retry.backoff_cap {self.backoff_cap} never applies: with limit "
                             f"{self.limit} the longest wait is {longest} s; drop it or "
                             "lower it")
        return self


def _place(key: str, kinds: tuple[str, ...]):
    """An AfterValidator that reads a URI with the steps' own parser (steps.uris)."""
    def check(value: str) -> str:
        if value:
            try:
                uris.parse(value, key, kinds)
            except StepError as exc:
                raise ValueError(str(exc)) from None
        return value
    return AfterValidator(check)


# A pod reads nothing from the submitting machine: on a cluster these URIs must be S3.
_CLUSTER_KINDS = {"train.resume_from": ("s3",)}


def _field(section: str, p: params.Param) -> tuple[Any, Any]:
    """A pydantic field from a step parameter: the same type, default, bounds and help."""
    annotation: Any = Literal[p.choices] if p.choices else p.type
    if p.uri_kinds:
        key = f"{section}.{p.name}"
        annotation = Annotated[annotation, _place(key, _CLUSTER_KINDS.get(key, p.uri_kinds))]
    if p.pattern:      # the parameter's own check, so the line says what the step's does
        annotation = Annotated[annotation, AfterValidator(_pattern_check(p))]
    default = ... if p.default is None else p.default
    finite = {"allow_inf_nan": False} if p.type is float else {}   # as Param.parse
    if p.type in (int, float):    # a number, never a boolean taken for 1 or 0
        annotation = Annotated[annotation, BeforeValidator(_not_a_boolean)]
    return annotation, Field(default, ge=p.ge, gt=p.gt, le=p.le, description=p.help,
                             **finite)


def _not_a_boolean(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"a number, not the boolean {str(value).lower()}")
    return value


def _pattern_check(p: params.Param):
    def check(value: str) -> str:
        problem = p.mismatch(value)
        if problem:
            raise ValueError(problem)
        return value
    return check


def _step_section(section: str) -> type[_Strict]:
    fields = {p.name: _field(section, p) for p in params.STEPS[section]}
    return create_model(section.capitalize(), __base__=_Strict, **fields)


Download = _step_section("download")
Preprocess = _step_section("preprocess")
Train = _step_section("train")
Convert = _step_section("convert")
Quantize = _step_section("quantize")
Evaluate = _step_section("evaluate")


class Toleration(_Strict):
    key: LabelKey
    operator: Literal["Exists", "Equal"] = "Exists"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


def seconds(duration: str) -> int:
    """``90s``, ``30m``, ``72h`` (the config's duration form) in whole seconds."""
    return int(durations.seconds(duration))


class StepResources(_Strict):
    cpu: str = Field("1", pattern=_QUANTITY)
    memory: str = Field("4Gi", pattern=_QUANTITY)
    timeout: str = Field("2h", pattern=_DURATION,
                         description="deadline of one attempt (the pod's activeDeadlineSeconds)")


class TrainResources(_Strict):
    accelerator: Literal["gaudi", "cuda", "cpu"] = "gaudi"
    timeout: str = Field("72h", pattern=_DURATION,
                         description="deadline of one training attempt")
    nodes: int = Field(1, ge=1, le=64, description="> 1 trains through a Kubeflow PyTorchJob")
    cpu: str = Field("32", pattern=_QUANTITY)
    memory: str = Field("500Gi", pattern=_QUANTITY)
    hugepages_2mi_per_card: str = Field(
        "5250Mi", pattern=r"^[1-9][0-9]*Mi$",
        description="2 MiB hugepages per Gaudi card; the pod asks this x train.devices "
                    "(42000Mi for 8 cards, Habana's 8-card Kubernetes example)")
    shm_size: str = Field("64Gi", pattern=_QUANTITY)
    node_selector: dict[LabelKey, LabelValue] = {}
    tolerations: list[Toleration] = []


class Resources(_Strict):
    # Task01's 750 cases, from the rates measured per case (docs/operations.md, "Sizing a
    # real run"): 24.4 GB in preprocess's pod (raw in, dataset out), 14.4 GB in the others.
    work_volume_size: str = Field("32Gi", pattern=_QUANTITY,
                                  description="emptyDir sizeLimit holding artifacts in a pod, "
                                              "and its ephemeral-storage request and limit")
    download: StepResources = StepResources(cpu="1", memory="2Gi", timeout="6h")
    # One worker process per CPU, each about 0.46 GiB of anonymous memory beside the step's
    # own 0.45 GiB, whatever the number of cases: 4.1 GiB at 8 (`python -m benchmarks
    # footprint`), so 8Gi with half of that to spare (page cache of the cases it reads and
    # writes is reclaimed under the limit).
    preprocess: StepResources = StepResources(cpu="8", memory="8Gi", timeout="6h")
    # With the base's parameters and CPUs on full-size cases (the same benchmark), whatever
    # the number of cases: convert 2.0 GiB of anonymous memory and the folds' ensemble, which
    # runs with convert's resources, 2.7 GiB; quantize 2.8 GiB, and 6.6 GiB on that ensemble
    # of five models; evaluate 1.7 GiB. Each with half again to spare (all were 16Gi).
    convert: StepResources = StepResources(cpu="4", memory="6Gi", timeout="2h")
    quantize: StepResources = StepResources(cpu="4", memory="12Gi", timeout="2h")
    evaluate: StepResources = StepResources(cpu="4", memory="4Gi", timeout="6h")
    # The folds' pool only joins their evaluation files: 0.8 GiB of resident memory, nearly
    # all of it steps.evaluate's imports, and 4 s of one CPU on two folds (2026-11-30).
    pool: StepResources = StepResources(cpu="1", memory="2Gi", timeout="1h")
    handoff: StepResources = Field(StepResources(cpu="1", memory="2Gi", timeout="2h"),
                                   description="multi-node only: share-dataset, collect-model")
    train: TrainResources = TrainResources()
    extra_env: Annotated[dict[EnvName, str], AfterValidator(_no_credentials)] = Field(
        {}, description="literal env for every step (tuning; never a credential)")


class Config(_Strict):
    pipeline: Pipeline = Pipeline()
    images: Images
    storage: Storage = Storage()
    memoize: Memoize = Memoize()
    retry: Retry = Retry()
    download: Download
    preprocess: Preprocess = Preprocess()
    train: Train = Train()
    convert: Convert = Convert()
    quantize: Quantize = Quantize()
    evaluate: Evaluate = Evaluate()
    resources: Resources = Resources()
    profiles: dict[str, dict[str, Any]] = {}
    local_profile: str = ""
    profile: str = Field("", description="the profile applied, filled in by load_config")

    def image(self, kind: str) -> Image:
        return getattr(self.images, kind)

    @property
    def quantizes(self) -> bool:
        return "quantize" in self.pipeline.stages

    @property
    def evaluates(self) -> bool:
        return "evaluate" in self.pipeline.stages

    @property
    def fans_out(self) -> bool:
        """One train, convert and evaluate per fold of ``pipeline.folds``."""
        return bool(self.pipeline.folds)

    @property
    def train_image_kind(self) -> str:
        return self.resources.train.accelerator


EXTENDS = "extends"   # a profile's key: the profile whose changes it starts from
SECTIONS = ("pipeline", "images", "storage", "memoize", "retry", "download", "preprocess",
            "train", "convert", "quantize", "evaluate", "resources")


def _merge(base: dict, update: dict) -> dict:
    """Deep-merge ``update`` into a copy of ``base`` (mappings merge, everything else replaces).

    An empty mapping replaces too: a profile's ``node_selector: {}`` must clear the base's
    Gaudi selector, or its pods wait unschedulable on a cluster without that label (seen
    on the real single-node cluster, issue 23)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and value and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _resolve_key(raw: dict, key: str) -> list[str]:
    """A dotted override key as a path; a bare key must belong to exactly one section."""
    if not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_-]+)*", key):
        raise ConfigError(f"override '{key}': not a key (use section.key=value)")
    if "." in key:
        return key.split(".")
    owners = [s for s in SECTIONS
              if s in Config.model_fields and _section_fields(s) and key in _section_fields(s)]
    if len(owners) == 1:
        return [owners[0], key]
    if not owners:
        raise ConfigError(f"override '{key}': unknown key")
    raise ConfigError(f"override '{key}': ambiguous, say one of "
                      + ", ".join(f"{o}.{key}" for o in owners))


def _section_fields(section: str) -> set[str]:
    annotation = Config.model_fields[section].annotation
    return set(getattr(annotation, "model_fields", {}))


def apply_override(raw: dict, item: str) -> dict:
    """Apply one ``key=value`` override to the raw mapping."""
    key, sep, text = item.partition("=")
    if not sep:
        raise ConfigError(f"override '{item}': expected key=value")
    path = _resolve_key(raw, key.strip())
    value: Any = text.strip()
    if value.startswith(("{", "[")):  # a mapping or list; scalars stay text for the model
        value = _yaml(value, f"override '{key}': value")
    node = raw
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{key}': {part} is not a section")
        node = child
    node[path[-1]] = value
    return raw


def _one_line(error: ValidationError, source: str) -> ConfigError:
    first = error.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return ConfigError(f"{source}: {loc}: unknown key")
    if first["type"] == "missing":
        return ConfigError(f"{source}: {loc}: required key is missing")
    message = first["msg"]
    message = re.sub(r"^(Value error, |Input should be )", "", message)
    if message.startswith(f"{loc} "):   # steps.uris names the key itself
        return ConfigError(f"{source}: {message}")
    if first["type"] == "string_pattern_mismatch":
        message = f"must match {first['ctx']['pattern']}"
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    return ConfigError(f"{source}: {loc}: must be {message}{shown}".replace("must be must",
                                                                         "must"))


class _StrictLoader(yaml.SafeLoader):
    """YAML as the config means it: a key given twice in one mapping is an error (PyYAML
    keeps the last), and only ``true``/``false`` are booleans (YAML 1.2), so that YAML 1.1's
    ``yes``, ``no``, ``on`` and ``off`` stay words and are refused where a number or a
    boolean is due, instead of silently becoming 1 or 0."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r:.80} is "
                                  "given twice in one mapping")
            seen.add(key)
        return super().construct_mapping(node, deep)


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool",
                                    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


def _yaml(text: str, where: str) -> Any:
    """``text`` parsed as YAML (:class:`_StrictLoader`); a syntax error, a repeated key or
    nesting that exhausts the parser's recursion is one ConfigError line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)   # noqa: S506 - a SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{where}:{line} is not valid YAML") from None
    except RecursionError:
        raise ConfigError(f"{where}: is nested too deeply to be a config") from None


def load_config(path: str | Path | None = None, profile: str | None = None,
                overrides: Sequence[str] = (), *, local: bool = False) -> Config:
    """Load, merge and validate the pipeline config; raise ConfigError (one line) if bad.

    ``local`` picks the file's ``local_profile`` when no profile is named.
    """
    path = Path(path or DEFAULT_CONFIG)
    source = f"config {path.name}"
    try:
        raw = _yaml(path.read_bytes().decode("utf-8"), f"config {path}") or {}
    except OSError as exc:
        raise ConfigError(f"config {path}: cannot read ({exc.strerror})")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path}: is not UTF-8 text (byte {exc.start}); save it "
                          "as UTF-8") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path}: top level must be a mapping")
    profiles = raw.get("profiles") or {}
    if not isinstance(profiles, dict):
        raise ConfigError(f"{source}: profiles: must be a mapping of name to overrides")
    _check_profiles(raw, profiles, source)
    name = profile if profile is not None else (raw.get("local_profile", "") if local else "")
    if name:
        if name not in profiles:
            raise ConfigError(f"profile '{name}': unknown (known: {', '.join(sorted(profiles))})")
        raw = _merge(raw, profile_body(profiles, name, source))
    raw["profile"] = name or ""
    for item in overrides:
        raw = apply_override(raw, item)
    try:
        config = Config.model_validate(with_defaults(raw))
    except ValidationError as exc:
        raise _one_line(exc, source) from None
    _check_consistency(config, source)
    return config


def with_defaults(raw: dict) -> dict:
    """``raw`` laid over each section's defaults, so that a partial mapping (a profile's
    ``resources.download: {timeout: 30m}``) changes only the keys it names; pydantic alone
    would build ``resources.download`` from the mapping and StepResources' own defaults."""
    out = dict(raw)
    for name, field in Config.model_fields.items():
        if isinstance(field.default, BaseModel) and isinstance(raw.get(name), dict):
            out[name] = _merge(field.default.model_dump(), raw[name])
    return out


def profile_body(profiles: dict, name: str, source: str, seen: tuple[str, ...] = ()) -> dict:
    """What profile ``name`` changes: its ``extends`` chain's changes, then its own."""
    body = profiles[name]
    if not isinstance(body, dict):
        raise ConfigError(f"{source}: profiles.{name}: must be a mapping")
    bad = sorted(set(body) - set(SECTIONS) - {EXTENDS})
    if bad:
        raise ConfigError(f"{source}: profiles.{name}.{bad[0]}: unknown key")
    own = {k: v for k, v in body.items() if k != EXTENDS}
    parent = body.get(EXTENDS)
    if parent is None:
        return own
    if not isinstance(parent, str) or parent not in profiles:
        raise ConfigError(f"{source}: profiles.{name}.{EXTENDS}: names no profile "
                          f"(got {parent!r:.80})")
    if parent in seen + (name,):
        raise ConfigError(f"{source}: profiles.{name}.{EXTENDS}: a cycle through "
                          f"{' -> '.join(seen + (name, parent))}")
    return _merge(profile_body(profiles, parent, source, seen + (name,)), own)


def _check_profiles(raw: dict, profiles: dict, source: str) -> None:
    """Every named profile must itself give a valid config; a bad one is named early."""
    for name in profiles:
        body = profile_body(profiles, name, source)
        try:
            merged = Config.model_validate(with_defaults(_merge(raw, body)))
        except ValidationError as exc:
            raise _one_line(exc, f"{source}: profiles.{name}") from None
        _check_consistency(merged, f"{source}: profiles.{name}")
    local = raw.get("local_profile") or ""
    if local and local not in profiles:
        raise ConfigError(f"{source}: local_profile: names unknown profile '{local}'")


def _strings(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """(dotted key, text) for every key and string value under ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            yield where, str(key)
            yield from _strings(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def _check_values(config: Config, source: str) -> None:
    """No value is an Argo template or holds a control character: every value reaches the
    compiled YAML as data, where ``{{...}}`` would be evaluated by the controller."""
    for where, text in _strings(config.model_dump(exclude={"profiles"}), ""):
        if _TEMPLATE.search(text):
            raise ConfigError(f"{source}: {where}: must not contain '{{{{' or '}}}}' (config "
                              f"values are data, never Argo template; got {text[:80]!r})")
        if unsafe_characters(text):
            raise ConfigError(f"{source}: {where}: must not contain control characters "
                              f"or Unicode format characters (got {text[:80]!r})")


def _check_consistency(config: Config, source: str) -> None:
    _check_values(config, source)
    for name, problem in params.train_relations(config.train, config.resources.train.nodes):
        raise ConfigError(f"{source}: train.{name}: {problem}")
    accelerator = config.resources.train.accelerator
    wanted = {"gaudi": "hpu", "cuda": "cuda", "cpu": "cpu"}[accelerator]
    if config.train.device not in ("auto", wanted):
        raise ConfigError(f"{source}: train.device: '{config.train.device}' does not match "
                          f"resources.train.accelerator '{accelerator}' (use {wanted} or auto)")
    if config.pipeline.folds and not config.evaluates:
        raise ConfigError(f"{source}: pipeline.folds: needs the evaluate stage in "
                          "pipeline.stages (each fold's evaluation is what the pool joins)")
    if config.pipeline.folds and config.resources.train.nodes > 1:
        raise ConfigError(f"{source}: pipeline.folds: a fan-out of folds trains each on one "
                          "node; resources.train.nodes must be 1")
    # Multi-node on the CPU accelerator is allowed: gloo across the job's pods is how the
    # PyTorchJob runs on the real operator in tests/test_multinode.py (issue 26).
