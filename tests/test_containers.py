"""containers/: no Docker engine runs here, so the Dockerfiles are checked by reading them
(pinned bases, non-root user, no secrets, Habana's torch never reinstalled), and the way
they install the project is replayed in a clean virtual environment.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from workflows.config import load_config

REPO = Path(__file__).resolve().parents[1]
CONTAINERS = REPO / "containers"
KINDS = ("cpu", "cuda", "gaudi")
TORCH_FAMILY = re.compile(r"^(torch|torchvision|torchaudio|triton|habana[-_].*)([=<>~!\[].*)?$",
                          re.IGNORECASE)
REINSTALL_FLAGS = {"-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I"}


# ---- a small Dockerfile reader -----------------------------------------------------------

@dataclass
class Stage:
    base: str
    name: str | None
    args: dict[str, str]
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [body for kw, body in self.instructions if kw == keyword]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, body = full.partition(" ")
        out.append((keyword.upper(), body.strip()))
    return out


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                  lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse_arg(body: str) -> tuple[str, str]:
    name, _, default = body.partition("=")
    return name.strip(), default.strip().strip('"')


def stages(text: str) -> list[Stage]:
    global_args: dict[str, str] = {}
    result: list[Stage] = []
    for keyword, body in instructions(text):
        if keyword == "FROM":
            parts = body.split()
            name = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else None
            result.append(Stage(substitute(parts[0], global_args), name, dict(global_args)))
        elif not result:
            if keyword == "ARG":  # a default may use the ARGs declared before it
                key, default = parse_arg(body)
                global_args[key] = substitute(default, global_args)
        else:
            stage = result[-1]
            if keyword == "ARG":
                key, default = parse_arg(body)
                stage.args[key] = default or global_args.get(key, "")
            stage.instructions.append((keyword, substitute(body, stage.args)
                                       if keyword != "RUN" else body))
    return result


def dockerfile(kind: str) -> Path:
    return CONTAINERS / f"Dockerfile.{kind}"


def final(kind: str) -> Stage:
    return stages(dockerfile(kind).read_text())[-1]


def pip_installs(run: str) -> list[list[str]]:
    """Each `pip install ...` command inside one RUN, as the tokens after `install`."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "(", ")", ">", ">>"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    found = []
    for tokens in commands:
        for i, token in enumerate(tokens[:-1]):
            if (token in ("pip", "pip3") or token.endswith("/pip")) and tokens[i + 1] == "install":
                found.append(tokens[i + 2:])
            if token == "-m" and tokens[i + 1] == "pip" and tokens[i + 2:i + 3] == ["install"]:
                found.append(tokens[i + 3:])
    return found


def config() -> dict:
    """The pipeline config with its defaults (config/pipeline.yaml states departures only)."""
    return load_config().model_dump()


def torch_untouched_problems(stage: Stage) -> list[str]:
    """Why a stage's pip commands could replace the base image's torch (empty: they cannot)."""
    problems = []
    runs = stage.all("RUN")
    for run in runs:
        if re.search(r"\bpip3?\s+uninstall\b", run):
            problems.append("pip uninstall")
        for args in pip_installs(run):
            targets = [a for a in args if not a.startswith("-")]
            if any(TORCH_FAMILY.match(t.strip("'\"")) for t in targets):
                problems.append(f"installs the torch family: {args}")
            if REINSTALL_FLAGS & set(args):
                problems.append(f"upgrade/reinstall flag: {args}")
            if not ({"-c", "--constraint"} & set(args)
                    or any(a.startswith("--constraint=") for a in args)):
                problems.append(f"pip install without the base image's constraints: {args}")
    if not any(re.search(r"pip\s+list\s+--format=freeze", run) for run in runs):
        problems.append("the constraints are not generated from the installed packages")
    return problems


# ---- the Dockerfiles ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_base_images_pinned(kind):
    parsed = stages(dockerfile(kind).read_text())
    names = {s.name for s in parsed if s.name}
    for stage in parsed:
        if stage.base in names:
            continue
        assert "$" not in stage.base, f"unresolved build argument in FROM {stage.base}"
        repository, _, tag = stage.base.rpartition(":")
        assert repository and "/" not in tag, f"FROM {stage.base} has no tag"
        assert tag != "latest" and "latest" not in tag, f"FROM {stage.base} is not pinned"


def test_bases_are_the_documented_images():
    cpu, cuda, gaudi = (final(kind).base for kind in KINDS)
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", cpu), cpu
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime", cuda), cuda
    match = re.fullmatch(r"vault\.habana\.ai/gaudi-docker/(\d+\.\d+\.\d+)/ubuntu[\d.]+/habanalabs/"
                         r"pytorch-installer-(\d+\.\d+\.\d+):(\d+\.\d+\.\d+)-\d+", gaudi)
    assert match, gaudi
    version, torch, tag_version = match.groups()
    assert version == tag_version
    # Gaudi software 1.22/1.23 ship torch 2.7 (Gaudi 2/3); 1.21 ships 2.6 (first-gen Gaudi).
    assert version.startswith("1.22.") and torch.startswith("2.7."), gaudi


def test_gaudi_first_generation_override_is_documented():
    text = dockerfile("gaudi").read_text()
    override = re.search(r"GAUDI_VERSION=(1\.21\.\d+).*GAUDI_BUILD=(\d+).*GAUDI_TORCH=(2\.6\.\d+)",
                         text)
    assert override, "the 1.21.x (first-gen Gaudi, AWS dl1) build arguments are not documented"
    makefile = (CONTAINERS / "Makefile").read_text()
    assert f"DL1_VERSION     ?= {override.group(1)}" in makefile


@pytest.mark.parametrize("kind", KINDS)
def test_final_stage_runs_as_the_configured_non_root_user(kind):
    stage = final(kind)
    users = stage.all("USER")
    assert users, f"Dockerfile.{kind}: the final stage sets no USER"
    user, _, group = users[-1].partition(":")
    assert user not in ("root", "0") and group not in ("root", "0"), users[-1]
    assert user == str(config()["pipeline"]["run_as_user"]), \
        "the image's uid differs from pipeline.run_as_user in config/pipeline.yaml"


SECRET_PATTERNS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),                                  # AWS access key id
    re.compile(r"(?i)aws_secret_access_key\s*[=:]\s*\S+"),
    re.compile(r"(?i)(password|passwd|secret|token)\s*[=:]\s*['\"]?\w{4,}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
]


@pytest.mark.parametrize("path", sorted(p for p in CONTAINERS.rglob("*") if p.is_file())
                         + [REPO / ".dockerignore"], ids=lambda p: p.name)
def test_no_secrets(path):
    text = path.read_text()
    for pattern in SECRET_PATTERNS:
        assert not pattern.search(text), f"{path.name}: {pattern.pattern}"


def test_dockerignore_keeps_secrets_and_state_out_of_the_context():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for pattern in (".git", ".env*", "*.env", "**/credentials*", ".venv", ".unet-local"):
        assert pattern in ignored, pattern


@pytest.mark.parametrize("kind", KINDS)
def test_copied_sources_exist_and_are_not_ignored(kind):
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for stage in stages(dockerfile(kind).read_text()):
        for body in stage.all("COPY"):
            if body.startswith("--from"):
                continue
            for source in body.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                assert source not in ignored, f"COPY {source}: excluded by .dockerignore"


@pytest.mark.parametrize("kind", ("cuda", "gaudi"))
def test_base_image_torch_is_never_reinstalled(kind):
    problems = torch_untouched_problems(final(kind))
    assert not problems, problems


def test_gaudi_constraints_cover_every_preinstalled_package():
    """Habana's stack (torch, habana-torch-plugin, numpy...) is a tested set: freeze all of it."""
    runs = " ".join(final("gaudi").all("RUN"))
    freeze = re.search(r"pip list --format=freeze\s*>\s*(\S+)", runs)
    assert freeze, "no constraints file is generated"
    assert f"--constraint {freeze.group(1)}" in runs


@pytest.mark.parametrize("snippet", [
    "RUN pip install torch==2.7.1 -c /tmp/c.txt",
    "RUN python3 -m pip install --upgrade -c /tmp/c.txt /w/x.whl",
    "RUN pip install /w/x.whl[train]",
    "RUN pip uninstall -y torch",
])
def test_torch_check_catches_reinstalls(snippet):
    """The rule above is live: each of these would touch Habana's torch."""
    stage = stages(f"FROM base:1\nRUN pip list --format=freeze > /tmp/c.txt\n{snippet}\n")[-1]
    assert torch_untouched_problems(stage)


def test_gaudi_environment():
    env = " ".join(final("gaudi").all("ENV"))
    assert re.search(r"PT_HPU_LAZY_MODE=0\b", env)
    for variable in ("HABANA_LOGS=/tmp", "TORCHINDUCTOR_CACHE_DIR=/tmp", "HOME="):
        assert variable in env


def test_cpu_image_is_multistage_with_optional_jemalloc():
    parsed = stages(dockerfile("cpu").read_text())
    assert len(parsed) >= 2
    build, runtime = parsed[0], parsed[-1]
    # torch comes from PyTorch's CPU index in the build stage, pinned by version
    assert any("--index-url" in run and "torch==${TORCH_VERSION}" in run for run in build.all("RUN"))
    assert "download.pytorch.org/whl/cpu" in build.args["TORCH_INDEX_URL"]
    # only the virtual environment crosses over; no compiler ships
    copies = runtime.all("COPY")
    assert copies and all(c.startswith(f"--from={build.name} /opt/venv") for c in copies), copies
    runtime_runs = " ".join(runtime.all("RUN"))
    assert "libjemalloc2" in runtime_runs
    for tool in ("build-essential", "gcc", "g++", "python3-dev"):
        assert tool not in runtime_runs
    link = re.search(r"ln -s .* (/[\w/.-]*libjemalloc\.so\.2)\b", runtime_runs)
    assert link, "libjemalloc is not linked to a fixed path"
    # measured slower than glibc malloc on the development machines, so opt-in only
    assert "LD_PRELOAD" not in " ".join(runtime.all("ENV"))


def test_cpu_image_installs_the_tested_versions():
    """The project's dependencies at the versions of .ci/constraints.txt (the set the suite
    last passed with, as CI installs it), not whatever is newest on the day of the build."""
    build = stages(dockerfile("cpu").read_text())[0]
    copies = [body.split() for body in build.all("COPY") if not body.startswith("--from")]
    target = next(parts[-1] for parts in copies if parts[0] == ".ci/constraints.txt")
    project = [args for run in build.all("RUN") for args in pip_installs(run)
               if any(a.startswith(".[") for a in args)]
    assert project
    for args in project:
        given = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-c", "--constraint")}
        assert target in given, args


def image_extras(kind: str) -> list[str]:
    args = {}
    for stage in stages(dockerfile(kind).read_text()):
        args.update(stage.args)
    return args["EXTRAS"].split(",")


def served_steps(kind: str) -> list[str]:
    runs = " ".join(final(kind).all("RUN"))
    loop = re.search(r"for step in ([\w ]+); do", runs)
    assert loop, f"Dockerfile.{kind} does not check its steps at build time"
    return loop.group(1).split()


@pytest.mark.parametrize("kind", KINDS)
def test_images_serve_every_stage_with_declared_extras(kind):
    pyproject = (REPO / "pyproject.toml").read_text()
    for extra in image_extras(kind):
        assert re.search(rf"^{extra} = \[", pyproject, re.MULTILINE), f"no extra [{extra}]"
    assert served_steps(kind) == config()["pipeline"]["stages"]


def makefile_vars() -> dict[str, str]:
    values = {}
    for line in (CONTAINERS / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Z_0-9]+)\s*[?:]?=\s*(.*)$", line)
        if match:
            values[match.group(1)] = match.group(2).strip()
    return values


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_makefile_builds_the_images_the_config_names():
    """Issue 28: the image names and tags are stated once, in config/pipeline.yaml; the
    Makefile reads them, and its Gaudi build arguments match the Gaudi tag."""
    done = subprocess.run(["make", "-s", "-C", str(CONTAINERS), "print"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    cpu, cuda, gaudi, dl1 = done.stdout.split()
    images = config()["images"]
    named = {kind: f"{images[kind]['repository']}:{images[kind]['tag']}" for kind in KINDS}
    assert (cpu, cuda, gaudi) == (named["cpu"], named["cuda"], named["gaudi"])
    make = makefile_vars()
    assert gaudi.endswith(f"-gaudi{make['GAUDI_VERSION']}")
    assert dl1 == gaudi.replace(make["GAUDI_VERSION"], make["DL1_VERSION"])
    moved = subprocess.run(["make", "-s", "-C", str(CONTAINERS), "print", "REGISTRY=r.example/t"],
                           capture_output=True, text=True, timeout=60).stdout.split()
    assert moved[0] == "r.example/t/" + cpu.rsplit("/", 1)[1]


# ---- replay the install in a clean virtual environment -----------------------------------

def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def copied_sources(kind: str) -> list[str]:
    sources = []
    for stage in stages(dockerfile(kind).read_text()):
        for body in stage.all("COPY"):
            if not body.startswith("--from"):
                sources += body.split()[:-1]
    return sources


def link_base_image_torch(target: Path) -> None:
    """Stand in for a base image's preinstalled torch: link this interpreter's torch and its
    runtime requirements (and nothing else) into ``target``, a directory a .pth file adds."""
    from importlib import metadata

    from packaging.requirements import Requirement

    target.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        dist = metadata.distribution(todo.pop())
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in seen:
            continue
        seen.add(key)
        todo += [r.name for r in map(Requirement, dist.requires or [])
                 if not r.marker or r.marker.evaluate({"extra": ""})]
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            if not top.endswith(".pth") and not (target / top).exists():
                (target / top).symlink_to(dist.locate_file(top))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_image_install_recipe_in_a_clean_venv(tmp_path):
    """What the images do, replayed: a venv without system packages sees only a preinstalled
    torch (this interpreter's, linked in like a base image's), then gets the project from
    exactly the files the Dockerfiles COPY, with the largest set of extras (the CPU image's)
    and the Gaudi image's strictest rule (every preinstalled package frozen as a
    constraint). torch must stay the base's and every step the images serve must start from
    the installed package."""
    extras = {kind: set(image_extras(kind)) for kind in KINDS}
    for kind in KINDS:   # the CPU image, which also runs quantize, adds the openvino extra
        assert extras[kind] <= extras["cpu"], f"{kind} installs extras the CPU image lacks"
    extras = {tuple(sorted(extras["cpu"]))}
    # The CPU image also installs at the tested versions (test_cpu_image_installs_the_tested_
    # versions); the others keep their base image's packages.
    sources = {tuple(s for s in copied_sources(kind) if s != ".ci/constraints.txt")
               for kind in KINDS}
    assert len(sources) == 1, f"the images copy different sources: {sources}"

    source = tmp_path / "src"
    source.mkdir()
    for item in sources.pop():
        src = REPO / item
        if src.is_dir():
            shutil.copytree(src, source / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, source / item)

    # --without-pip: the venv holds nothing of its own; pip runs from outside (--python).
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               env=env).stdout.strip()
    base = tmp_path / "base-image-site"
    link_base_image_torch(base)
    Path(site, "base_image.pth").write_text(f"{base}\n")

    freeze = pip + ["list", "--format=freeze"]
    before = run(freeze, env=env).stdout
    torch_before = re.search(r"^torch==(.+)$", before, re.MULTILINE).group(1)
    assert not re.search(r"^(monai|onnx|boto3|nibabel)==", before, re.MULTILINE | re.IGNORECASE)
    constraints = tmp_path / "base-constraints.txt"
    constraints.write_text(before)

    run(pip + ["install", "--quiet", "--constraint", str(constraints),
               f"{source}[{','.join(extras.pop())}]"], env=env, timeout=600)
    after = run(freeze, env=env).stdout
    assert re.search(r"^torch==(.+)$", after, re.MULTILINE).group(1) == torch_before

    workdir = tmp_path / "work"      # not the repository: the installed package must be used
    workdir.mkdir()
    origin = run([python, "-c", "import steps, torch; print(steps.__file__); print(torch.__file__)"],
                 cwd=workdir, env=env).stdout.split()
    assert origin[0].startswith(site), origin
    assert origin[1].startswith(str(base)), "torch was reinstalled into the venv"
    for step in served_steps("cpu"):
        done = run([python, "-m", f"steps.{step}", "--help"], cwd=workdir, env=env, timeout=120)
        assert "--" in done.stdout and "usage" in done.stdout.lower(), step
