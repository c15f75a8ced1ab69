"""The Argo UI as a person uses it: the real ``argo server`` of the test cluster, its UI built
from the Argo module's own ``ui/`` source (``cluster/build.sh ui``), driven by Playwright in
Debian's headless Chromium. Each test is something a user does: fill the published template's
form, watch the DAG, read why a step failed, press Retry, Resubmit, Stop and Delete, and open
the released model and the training report through the server's artifact proxy.

Screenshots go to ``$UNET_UI_SHOTS`` (default: a temporary folder);
``UNET_UI_SHOTS=docs/ui python -m pytest -m ui`` refreshes the pictures of docs/ui.md.
Without Playwright or Chromium the tests skip with the reason; in CI
(``UNET_REQUIRE_CLUSTER=1``) they fail instead, like the cluster they run on.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import requests

from real_cluster import (ARGO_CA, ARGO_URL, BUCKET, CFG, NAMESPACE, NODE_ANNOTATION, REQUIRED,
                          argo_nodes, cli, compiled, kubectl, pods_of, request, unique, until,
                          wait)

try:
    from playwright.sync_api import TimeoutError as UiTimeout, expect, sync_playwright
except ImportError:          # the tests skip with the reason, or fail in CI (_unavailable)
    sync_playwright = None

pytestmark = [pytest.mark.ui, pytest.mark.slow, pytest.mark.timeout(1800)]

CHROMIUM = os.environ.get("UNET_CHROMIUM") or shutil.which("chromium-headless-shell") or ""
TEMPLATE = CFG.pipeline.model_name
STEPS = ("download", "preprocess", "train", "convert")   # the cluster profile's DAG
UI_WAIT_MS = 60_000


def _unavailable() -> str:
    if sync_playwright is None:
        return "playwright is not installed (pip install -e '.[dev]')"
    if not CHROMIUM:
        return "Chromium not found: apt-get install chromium-headless-shell (or set UNET_CHROMIUM)"
    if not shutil.which("certutil"):
        return "certutil not found: apt-get install libnss3-tools (to trust the server's CA)"
    return ""


@pytest.fixture(scope="module")
def browser(argo, tmp_path_factory):
    """Chromium for a person who has imported the cluster's CA (cluster/up.sh) into their
    browser: Chromium on Linux trusts what ``$HOME/.pki/nssdb`` marks as a CA."""
    why = _unavailable()
    if why:
        (pytest.fail if REQUIRED else pytest.skip)(why)
    home = tmp_path_factory.mktemp("browser-home")
    nssdb = f"sql:{home}/.pki/nssdb"
    (home / ".pki" / "nssdb").mkdir(parents=True)
    for args in (["-N", "--empty-password"],
                 ["-A", "-t", "C,,", "-n", "unet-cluster argo-server CA", "-i", str(ARGO_CA)]):
        subprocess.run(["certutil", "-d", nssdb, *args], check=True, capture_output=True)
    with sync_playwright() as playwright:   # Debian's binary: Playwright's download fails here
        chromium = playwright.chromium.launch(executable_path=CHROMIUM,
                                              env={**os.environ, "HOME": str(home)})
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def user(browser, argo, shots):
    """One person's browser profile for the module, logged in as the README says: the
    server runs ``--auth-mode=client``, so the UI sends a visitor without a token to its
    login page, where they paste ``Bearer <token>`` (here unet-user's, manifests/base/users.yaml).
    The welcome dialogs that Argo shows a first-time visitor (a survey, the version's news)
    are closed once, as a person would."""
    context = browser.new_context(base_url=ARGO_URL, viewport={"width": 1440, "height": 900})
    context.set_default_timeout(UI_WAIT_MS)
    page = context.new_page()
    page.goto(f"/workflows/{NAMESPACE}")
    page.wait_for_url(re.compile(r"/login"))        # 401 from the API: ui/src/shared/services
    page.locator("#token").wait_for()
    page.screenshot(path=shots / "login.png")      # before the token is in it: no secret there
    page.locator("#token").fill(argo.token)
    page.locator(".login__token-section a").filter(has_text="Login").click()
    page.goto(f"/workflows/{NAMESPACE}")
    page.locator(".page").first.wait_for()
    for _ in range(3):      # ui/src/modals/modal-switch.tsx: at most one at a time
        try:
            page.locator(".modal-close").first.click(timeout=5000)
        except UiTimeout:
            break
    page.close()
    yield context
    context.close()


@pytest.fixture
def page(user):
    tab = user.new_page()
    yield tab
    tab.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("UNET_UI_SHOTS") or tmp_path_factory.mktemp("ui-shots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def published(argo) -> dict:
    """``publish`` as a user runs it; the WorkflowTemplate as the server returns it."""
    run = cli(argo, "publish")
    assert run.returncode == 0, run.stderr
    reply = fetch(argo, f"api/v1/workflow-templates/{NAMESPACE}/{TEMPLATE}")
    assert reply.ok, f"HTTP {reply.status_code} {reply.text[:300]}"
    return reply.json()


def fetch(argo, path: str) -> requests.Response:
    """GET ``path`` from argo server as the logged-in browser does (its cookie, the CA)."""
    return request("get", path, cookies={"authorization": argo.token})


# ---- what a person does on a page --------------------------------------------------------------
def open_submit_form(page, query: str = ""):
    """The template's page with its Submit panel open (the toolbar's SUBMIT does the same)."""
    page.goto(f"/workflow-templates/{NAMESPACE}/{TEMPLATE}?sidePanel=submit{query}")
    panel = page.locator(".sliding-panel")
    panel.get_by_role("heading", name="Submit Workflow").wait_for()
    return panel


def form_row(panel, name: str):
    """The row of parameter ``name`` in a Submit, Retry or Resubmit panel: label, help, input."""
    return panel.locator("label").filter(has_text=re.compile(f"^{re.escape(name)}$")).locator("..")


def set_parameter(panel, name: str, value: str) -> None:
    row = form_row(panel, name)
    row.locator("textarea, .select").first.wait_for()     # the form has rendered the row
    if row.locator(".select").count():
        row.locator(".select__value").click()
        row.locator(".select__option").filter(has_text=re.compile(f"^\\s*{value}\\s*$")).click()
    else:
        row.locator("textarea").fill(value)


def press_button(panel, label: str) -> None:
    panel.locator("button").filter(has_text=re.compile(f"^\\s*{label}\\s*$")).click()


def toolbar(page, action: str) -> None:
    """A button of the workflow page's toolbar: RETRY, RESUBMIT, STOP, DELETE, ..."""
    page.locator(".top-bar button").filter(
        has_text=re.compile(f"^\\s*{action}\\s*$", re.I)).first.click()


def confirm(page) -> None:
    """OK in the confirmation dialog that Stop and Delete open."""
    page.locator(".popup-overlay button, .popup button").filter(
        has_text=re.compile("^\\s*OK\\s*$", re.I)).first.click()


def opened_workflow(page, leaving: str = "") -> str:
    """The workflow the page went to (the UI opens it after a submit or a resubmit), other
    than ``leaving``, the one it showed before."""
    pattern = re.compile(rf"/workflows/{NAMESPACE}/([a-z0-9][a-z0-9.-]*)")
    page.wait_for_url(lambda url: (m := pattern.search(url)) is not None
                      and m.group(1) != leaving)
    return pattern.search(page.url).group(1)


def error_notice(page):
    """The error notice above a page's content (v4.0.5 ui/src/shared/components/
    error-notice.tsx: a white box whose first span holds a failed-phase icon and the error)."""
    return page.locator(".white-box").filter(
        has=page.locator(":scope > span > i.status-icon--failed"))


def reload_watching(page) -> None:
    """Reload a workflow's page, then wait until it watches the workflow with no error notice.
    A watch that fails (its EventSource closes: 'Failed to connect to api/v1/workflow-events/
    ...') shows a notice, and the page opens a new watch 3 s later, whose opening clears it
    (v4.0.5 ui/src/shared/retry-observable.ts, reconnectAfterMs; workflow-details.tsx, the
    watch's onOpen). While a notice shows, DELETE deletes the workflow but stays on its page
    (workflow-details.tsx: ``if (error !== null) return;`` before it goes to the list)."""
    with page.expect_response(lambda r: "/api/v1/workflow-events/" in r.url and r.ok):
        page.reload()
    expect(error_notice(page)).to_have_count(0, timeout=UI_WAIT_MS)


def graph_node(page, label: str):
    """A node of the DAG graph by its label (a task, an attempt ``train(0)``, an artifact):
    the graph draws each as a group of the node's shape and, beside it, its label."""
    group = page.locator("g:has(> title)").filter(
        has=page.locator("text.node-label", has_text=re.compile(f"^{re.escape(label)}$")))
    return group.locator("g.node")


def node_info(page, task: str):
    """Click ``task`` in the DAG; the node's panel with its fields (PHASE, MESSAGE, ...)."""
    graph_node(page, task).first.click()
    info = page.locator(".workflow-node-info, .workflow-details__step-info").first
    info.wait_for()
    return info


def task_nodes(wf: dict) -> dict[str, dict]:
    """DAG task -> its node (the Retry node where there is one), by display name."""
    return {n["displayName"]: n for n in (wf["status"].get("nodes") or {}).values()
            if n["displayName"] in STEPS}


# ---- the published template's form ---------------------------------------------------------
def test_the_form_describes_every_parameter_and_offers_our_choices(page, published, shots):
    """Every parameter of the published template is in the form with its description (the
    help icon's tooltip) and its default; an enum is a drop-down of exactly our values."""
    panel = open_submit_form(page)
    for parameter in parameters_of(published):
        name, description = parameter["name"], parameter.get("description", "")
        row = form_row(panel, name)
        assert row.count() == 1, name
        assert description, f"{name} has no description"
        row.locator(".fa-question-circle").hover()
        page.locator(".tippy-popper").filter(has_text=description).wait_for(state="visible")
        if name == "precision":
            page.screenshot(path=shots / "form.png")
        if parameter.get("enum"):
            assert row.locator(".select__value").inner_text().strip() == parameter["value"]
            row.locator(".select__value").click()          # the drop-down opens
            row.locator(".select__options.opened").wait_for(state="visible")
            options = row.locator(".select__options.opened .select__option")
            assert [o.strip() for o in options.all_inner_texts()] == parameter["enum"], name
            options.filter(has_text=re.compile(f"^\\s*{parameter['value']}\\s*$")).click()
        else:
            assert row.locator("textarea").input_value() == parameter.get("value", ""), name
        page.mouse.move(0, 0)


def parameters_of(doc: dict) -> list[dict]:
    return doc["spec"]["arguments"]["parameters"]


# ---- a run from the form, its graph and its artifacts ------------------------------------------
@pytest.fixture(scope="module")
def form_run(user, published, argo) -> dict:
    """A run submitted from the form as a person fills it (one epoch, fp32 chosen)."""
    page = user.new_page()
    panel = open_submit_form(page)
    set_parameter(panel, "max-epochs", "1")
    set_parameter(panel, "precision", "fp32")
    press_button(panel, "Submit")
    name = opened_workflow(page)
    page.close()
    return wait(argo, name)


def test_submit_from_the_form_runs_the_dag_and_the_graph_shows_every_step(page, form_run,
                                                                           shots):
    assert form_run["status"]["phase"] == "Succeeded", form_run["status"].get("message")
    given = {p["name"]: p.get("value") for p in form_run["spec"]["arguments"]["parameters"]}
    assert given["max-epochs"] == "1"
    assert form_run["metadata"]["labels"].get("submit-from-ui") == "true"
    page.goto(f"/workflows/{NAMESPACE}/{form_run['metadata']['name']}")
    for task in STEPS:
        graph_node(page, task).first.wait_for()
    assert "Succeeded" in node_info(page, "convert").inner_text()
    page.screenshot(path=shots / "dag.png")


def open_report(page, workflow: str) -> None:
    """From the workflow's page, train's ``report`` artifact as the UI links it (the node's
    INPUTS/OUTPUTS tab), its folder listing, then report.html with both figures loaded."""
    page.goto(f"/workflows/{NAMESPACE}/{workflow}")
    info = node_info(page, "train(0)")
    info.get_by_text(re.compile("^\\s*INPUTS/OUTPUTS\\s*$", re.I)).first.click()
    href = info.locator("a[href*='/outputs/report']").first.get_attribute("href")
    assert href and "artifact-files/" in href, href
    page.goto(href)                                       # the folder: its files, listed
    page.get_by_role("link", name="report.html").click()
    page.get_by_role("heading", name="U-Net training report").wait_for()
    assert page.locator("img").count() == 2
    until(lambda: page.evaluate(
        "[...document.images].every(i => i.complete && i.naturalWidth > 0)"),
        30, "the report's figures", every=1)


def test_the_report_and_the_model_open_through_the_artifact_proxy(page, form_run, argo, shots):
    """The training report (HTML with its curves) renders from train's ``report`` artifact,
    and the released ONNX model downloads, both through argo server's artifact proxy with the
    repository credentials of the namespace's Secret, as the UI links them."""
    name = form_run["metadata"]["name"]
    nodes = task_nodes(form_run)
    open_report(page, name)
    page.screenshot(path=shots / "report-smoke.png", full_page=True)  # docs: the learned one
    convert = next(n for n in form_run["status"]["nodes"].values()
                   if n["displayName"].startswith("convert") and n["type"] == "Pod")
    model = fetch(argo, f"artifact-files/{NAMESPACE}/workflows/{name}/{convert['id']}"
                        "/outputs/release/unet2d.onnx")
    assert model.ok and model.content[:1] == b"\x08", (model.status_code, model.text[:200])
    assert nodes["convert"]["phase"] == "Succeeded"


# ---- reruns from the UI ----------------------------------------------------------------------
def test_resubmit_takes_download_and_preprocess_from_the_cache(page, form_run, argo, shots):
    """RESUBMIT on a finished run: a new workflow of the same spec, whose download and
    preprocess are cache hits, shown as such in the node's panel."""
    first = form_run["metadata"]["name"]
    page.goto(f"/workflows/{NAMESPACE}/{first}")
    toolbar(page, "RESUBMIT")
    panel = page.locator(".sliding-panel")
    press_button(panel, "Resubmit")
    name = opened_workflow(page, leaving=first)
    wf = wait(argo, name)
    assert wf["status"]["phase"] == "Succeeded"
    hits = {t for t, n in task_nodes(wf).items() if (n.get("memoizationStatus") or {}).get("hit")}
    assert hits == {"download", "preprocess"}
    reload_watching(page)
    text = node_info(page, "preprocess").inner_text()
    assert re.search(r"HIT\?\s*YES", text), text
    page.screenshot(path=shots / "resubmit-memoized.png")


def test_a_value_outside_its_choices_fails_with_the_reason_and_retry_reruns_only_that(
        page, published, argo, shots):
    """A value outside a parameter's choices, here from a shared link's ``parameters[...]``
    query, which the form takes as given. Argo v4.0.5 does not check a submitted value
    against the template's enum (workflow/validate/validate.go: the submitted parameter,
    which has no enum, replaces the template's in util.MergeParameters), so the run starts;
    train refuses the value at once with our one line (exit 2, not retried), which the
    failed node shows. RETRY with the value fixed reruns train and what follows only."""
    panel = open_submit_form(page, "&parameters[precision]=fp64")
    set_parameter(panel, "max-epochs", "1")
    press_button(panel, "Submit")
    name = opened_workflow(page)
    wf = wait(argo, name)
    assert wf["status"]["phase"] == "Failed"
    before = task_nodes(wf)
    assert len(before["train"].get("children") or []) == 1, "bad input is not retried"
    attempt = wf["status"]["nodes"][before["train"]["children"][0]]
    assert attempt["message"].startswith("main: Error (exit code 2): error: "), attempt
    assert "precision: must be one of auto, fp32, bf16, fp16 (got 'fp64')" in attempt["message"]
    reload_watching(page)
    text = node_info(page, "train(0)").inner_text()
    assert "must be one of auto, fp32, bf16, fp16 (got 'fp64')" in text, text
    page.screenshot(path=shots / "failed-node.png")

    page.goto(f"/workflows/{NAMESPACE}/{name}")
    toolbar(page, "RETRY")
    panel = page.locator(".sliding-panel")
    override = form_row(panel, "Override Parameters").locator(".argo-checkbox input")
    override.check()
    set_parameter(panel, "precision", "auto")
    press_button(panel, "Retry")
    until(lambda: argo.get_workflow(name)["status"].get("phase") == "Running", 180,
          "the retry", every=1)
    retried = wait(argo, name)
    assert retried["status"]["phase"] == "Succeeded", retried["status"].get("message")
    after = task_nodes(retried)
    for task in ("download", "preprocess"):    # kept as they were: not run again
        assert after[task]["startedAt"] == before[task]["startedAt"], task
    assert after["train"]["phase"] == after["convert"]["phase"] == "Succeeded"


# ---- Stop and Delete -------------------------------------------------------------------------
def test_stop_and_delete_leave_no_pod_behind(page, published, argo, shots):
    """STOP while train runs: no pod of the workflow keeps running; DELETE: the workflow
    and all its pods are gone."""
    panel = open_submit_form(page)
    set_parameter(panel, "max-epochs", "500")
    set_parameter(panel, "min-epochs", "500")
    press_button(panel, "Submit")
    name = opened_workflow(page)
    until(lambda: (task_nodes(argo.get_workflow(name)).get("train") or {}).get("phase")
          == "Running", 600, "train to run", every=1)
    toolbar(page, "STOP")
    confirm(page)
    until(lambda: argo.get_workflow(name)["status"].get("phase") in ("Failed", "Error"),
          180, "the stopped workflow to end", every=1)
    # As docs/ui.md says: Failed, and why (v4.0.5 workflow/controller/operator.go, operate:
    # a shut-down workflow whose DAG node failed is "Stopped with strategy 'Stop'").
    status = argo.get_workflow(name)["status"]
    assert (status["phase"], status.get("message")) == (
        "Failed", "Stopped with strategy 'Stop'"), status
    until(lambda: not [p for p in pods_of(name)
                       if p["status"].get("phase") in ("Pending", "Running")],
          180, "its pods to stop", every=1)
    reload_watching(page)
    page.screenshot(path=shots / "stopped.png")
    toolbar(page, "DELETE")
    confirm(page)
    try:
        page.wait_for_url(re.compile(rf"/workflows/{NAMESPACE}/?(\?.*)?$"))
    except UiTimeout:
        notices = error_notice(page).all_inner_texts()
        raise AssertionError(f"DELETE left the page at {page.url}; its notices: {notices}") \
            from None
    until(lambda: fetch(argo, f"api/v1/workflows/{NAMESPACE}/{name}").status_code == 404, 180,
          "the workflow to go", every=1)
    until(lambda: not pods_of(name), 180, "its pods to go", every=1)


# ---- nnU-Net's folds (issue 49) ---------------------------------------------------------------
FOLDS = (0, 1, 2, 3, 4)
KILLED = 2       # the fold whose train pod is deleted mid-run


def argo_phase(argo, workflow: str, display_name: str) -> str | None:
    """The phase Argo's workflow status gives the node ``display_name``."""
    nodes = (argo.get_workflow(workflow).get("status") or {}).get("nodes") or {}
    return next((n["phase"] for n in nodes.values() if n["displayName"] == display_name), None)


def task_nodes_by_name(wf: dict) -> dict[str, dict]:
    """Every node of ``wf`` by its display name."""
    return {n["displayName"]: n for n in wf["status"]["nodes"].values()}


def queued_train(argo, workflow: str) -> str | None:
    """The last fold's train attempt that Argo shows Pending because the node has no CPU left
    for it: Argo copies the scheduler's reason into the node's message (v4.0.5 operator.go
    getPendingReason: "Unschedulable: 0/1 nodes are available: 1 Insufficient cpu. ...")."""
    nodes = (argo.get_workflow(workflow).get("status") or {}).get("nodes") or {}
    queued = sorted(n["displayName"] for n in nodes.values()
                    if re.fullmatch(r"train-fold-\d\(0\)", n["displayName"])
                    and n["phase"] == "Pending" and "Insufficient cpu" in n.get("message", ""))
    return queued[-1] if queued else None


def running_main(workflow: str, node: str) -> str | None:
    """The pod of Argo node ``node`` once its step runs (found by NODE_ANNOTATION)."""
    for pod in pods_of(workflow):
        if pod["metadata"].get("annotations", {}).get(NODE_ANNOTATION) == node and any(
                c["name"] == "main" and "running" in c.get("state", {})
                for c in pod["status"].get("containerStatuses", [])):
            return pod["metadata"]["name"]
    return None


@pytest.mark.beyond_ci
def test_five_folds_fan_out_side_by_side_and_join_in_the_ensemble_and_the_pool(page, argo,
                                                                                shots):
    """The cluster profile with ``pipeline.folds`` on 10 tiny cases (2 held out per fold), on
    Argo's own controller, one fold's train pod deleted while it trains: that train alone is
    retried; every fold's train, convert and evaluate Succeeded, at least two
    trains ran at the same time (the node has room for two 1-CPU pods), the pool's means are
    the workflow's outputs, the ensemble of the five is the released model. The graph draws
    the fan-out, its middle folds collapsed until clicked (docs/ui/folds.png)."""
    doc = compiled("download.source=synthetic://?cases=10&shape=32x32x16&seed=0",
                   f"pipeline.folds=[{','.join(map(str, FOLDS))}]",
                   "pipeline.stages=[download,preprocess,train,convert,evaluate]")
    name = argo.create_workflow(doc)["metadata"]["name"]
    # Five 1-CPU trains on a 2-CPU node: the scheduler keeps some Pending, queued, not failed
    # (a pod's activeDeadlineSeconds counts from its start on the node, which a queued pod
    # has not had: kubelet active_deadline.go); the graph shows the wait and its reason.
    queued = until(lambda: queued_train(argo, name), 900, "a train queued for CPU", every=0.5)
    page.goto(f"/workflows/{NAMESPACE}/{name}")
    graph_node(page, f"{len(FOLDS) - 2} hidden nodes").first.click()
    text = node_info(page, queued).inner_text()
    assert "Pending" in text and "Insufficient cpu" in text, text
    page.screenshot(path=shots / "queued.png", full_page=True)
    # One fold's train pod deleted while it trains, as an operator or an autoscaler does,
    # once Argo has it Running: a node still Pending in the workflow whose pod is gone is
    # submitted again under the same attempt (v4.0.5 operator.go podReconciliation: "If the
    # node is pending and the pod does not exist ... try to submit it again"), seen here.
    attempt = f"train-fold-{KILLED}(0)"
    killed = until(lambda: argo_phase(argo, name, attempt) == "Running"
                   and running_main(name, f"{name}.{attempt}"), 900,
                   f"{attempt} to run", every=0.5)
    kubectl("-n", NAMESPACE, "delete", "pod", killed, "--wait=false")
    wf = wait(argo, name, timeout=1800)
    assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
    table = argo_nodes(wf)
    per_fold = [f"{step}-fold-{k}" for k in FOLDS for step in ("train", "convert", "evaluate")]
    assert {t: table[t]["phase"] for t in [*per_fold, "ensemble", "pool"]} == dict.fromkeys(
        [*per_fold, "ensemble", "pool"], "Succeeded")
    # that fold's train alone ran again: its retry, every other node one attempt
    assert {t: table[t]["attempts"] for t in per_fold} == {
        t: 2 if t == f"train-fold-{KILLED}" else 1 for t in per_fold}
    trains = sorted((n["startedAt"], n["finishedAt"]) for n in wf["status"]["nodes"].values()
                    if re.fullmatch(r"train-fold-\d", n["displayName"]))
    assert any(later[0] < earlier[1] for earlier, later in zip(trains, trains[1:])), trains
    outputs = {p["name"]: p["value"] for p in wf["status"]["outputs"]["parameters"]}
    assert {k: outputs[k] for k in ("dice-wt", "dice-tc", "dice-et")} == {
        k: table["pool"]["parameters"][k] for k in ("dice-wt", "dice-tc", "dice-et")}
    assert table["ensemble"]["artifacts"]["release"] == f"models/{TEMPLATE}/{name}"
    page.goto(f"/workflows/{NAMESPACE}/{name}")
    for task in ("ensemble", "pool"):
        graph_node(page, task).first.wait_for()
    # Argo's graph draws a node's first and last child of more than 3 and collapses the rest
    # into one "N hidden nodes", which a click expands (v4.0.5 ui/src/workflows/components/
    # workflow-dag/workflow-dag.tsx: pushChildren, selectNode)
    graph_node(page, f"{len(FOLDS) - 2} hidden nodes").first.click()
    for k in FOLDS:
        for step in ("train", "convert", "evaluate"):
            graph_node(page, f"{step}-fold-{k}").first.wait_for()
    assert "Succeeded" in node_info(page, "pool").inner_text()
    page.screenshot(path=shots / "folds.png", full_page=True)


@pytest.mark.beyond_ci
def test_a_fold_that_fails_for_good_is_retried_alone_from_the_ui(page, argo, store, shots):
    """Two folds; fold 1's checkpoint pointer damaged before its train starts (an object in
    the user's S3 that they can repair): that train exits 2 at once with the line naming the
    object, is not retried, and the workflow Fails with it once fold 0 has run to its end
    (what needs fold 1 is omitted). The pointer removed, RETRY in the UI: fold 1's train and
    what follows it run and the DAG completes; fold 0's nodes are kept as they were
    (docs/ui/fold-retried.png)."""
    name = unique("unet-fold-retry")
    doc = compiled("download.source=synthetic://?cases=10&shape=32x32x16&seed=0",
                   "pipeline.folds=[0,1]",
                   "pipeline.stages=[download,preprocess,train,convert,evaluate]", name=name)
    pointer = f"{CFG.storage.checkpoint_prefix}/{name}/fold-1/latest"
    store.client().put_object(Bucket=BUCKET, Key=pointer, Body=b"not-a-checkpoint\n")
    argo.create_workflow(doc)
    wf = wait(argo, name, timeout=1800)
    assert wf["status"]["phase"] == "Failed", wf["status"].get("message")
    before = argo_nodes(wf)
    assert before["train-fold-1"]["exit_codes"] == [2], before["train-fold-1"]  # not retried
    fold_0 = ("train-fold-0", "convert-fold-0", "evaluate-fold-0")
    assert {t: before[t]["phase"] for t in fold_0} == dict.fromkeys(fold_0, "Succeeded")
    fault = (f"checkpoint pointer s3://{BUCKET}/{pointer} names 'not-a-checkpoint', "
             "not a checkpoint file")
    first = task_nodes_by_name(wf)
    attempt = first["train-fold-1(0)"]
    assert attempt["message"] == f"main: Error (exit code 2): error: {fault}", attempt
    page.goto(f"/workflows/{NAMESPACE}/{name}")
    assert fault in node_info(page, "train-fold-1(0)").inner_text()
    page.screenshot(path=shots / "fold-failed.png", full_page=True)

    store.client().delete_object(Bucket=BUCKET, Key=pointer)
    toolbar(page, "RETRY")
    press_button(page.locator(".sliding-panel"), "Retry")
    until(lambda: argo.get_workflow(name)["status"].get("phase") == "Running", 180,
          "the retry", every=1)
    retried = wait(argo, name, timeout=1800)
    assert retried["status"]["phase"] == "Succeeded", retried["status"].get("message")
    after, nodes = argo_nodes(retried), task_nodes_by_name(retried)
    assert {t: nodes[t]["startedAt"] for t in fold_0} == {
        t: first[t]["startedAt"] for t in fold_0}, "fold 0 ran again"
    assert [after[t]["attempts"] for t in fold_0] == [1, 1, 1]
    assert after["train-fold-1"]["phase"] == "Succeeded"
    assert after["train-fold-1"]["exit_codes"][-1] == 0
    assert after["ensemble"]["phase"] == after["pool"]["phase"] == "Succeeded"
    reload_watching(page)
    graph_node(page, "ensemble").first.wait_for()
    page.screenshot(path=shots / "fold-retried.png", full_page=True)


# The `local` profile's data and training (config/pipeline.yaml: 400 steps reach a mean Dice of
# about 0.87) in the cluster profile's 1-CPU pods.
LEARNING = ("download.source=synthetic://?cases=10&shape=64x64x24&seed=0",
            "preprocess.patch_size=64x64", "train.batch_size=16", "train.val_batch_size=32",
            "train.learning_rate=4.0e-3", "train.max_epochs=8", "train.steps_per_epoch=50",
            "resources.train.timeout=30m")


@pytest.mark.beyond_ci
def test_the_report_of_a_run_that_learned_opens_with_its_table(page, argo, shots):
    """A run that learned, not the 10-step smoke: train's report through the artifact proxy
    opens with the table of the best epoch's mean Dice and Dice per label, which are the
    node's output (docs/ui/report.png)."""
    name = argo.create_workflow(compiled(*LEARNING))["metadata"]["name"]
    wf = wait(argo, name, timeout=1800)
    assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
    dice = argo_nodes(wf)["train"]["parameters"]["mean-dice"]
    assert float(dice) > 0.8, dice
    open_report(page, name)
    summary = page.locator("table.summary").inner_text()
    shown = re.search(r"best mean Dice\s+([0-9.]+) \(epoch \d+\)", summary)
    assert shown and abs(float(shown.group(1)) - float(dice)) <= 1e-4, summary
    assert re.search(r"Dice edema\s+0\.\d{4}", summary), summary
    assert page.locator("pre").count() == 0                     # no JSON dump
    page.screenshot(path=shots / "report.png", full_page=True)
