"""Prometheus export: GuardMetrics fed by real guarded runs, its HTTP endpoint and
Pushgateway mode, the alert rules under promtool, and one real Prometheus server that
scrapes a training run with an injected fault and fires the SDC alert."""

import dataclasses
import http.server
import importlib.resources
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry


import sdc_guard  # noqa: E402
from respond_helpers import closure_for, make_model  # noqa: E402
from sdc_guard import GemmFault, Policy  # noqa: E402
from sdc_guard.metrics import DEFAULT_PORT, OTHER_SITE, GuardMetrics, default_port  # noqa: E402
from sdc_guard.respond.policy import ACTIONS, CLASSIFICATIONS  # noqa: E402

#: The installed rules and dashboard (package data of sdc_guard.integrations).
PROM_DIR = Path(str(importlib.resources.files("sdc_guard.integrations") / "prometheus"))

#: GEMMs of one step of ``make_model()`` (TinyGPT, one block), by (op, phase, dtype):
#: forward: qkv, proj, fc1, fc2, head (addmm) and two attention bmm; backward: grad
#: input and grad weight of the five linears (mm) and two per attention bmm.
PER_STEP = {("addmm", "forward", "float32"): 5, ("bmm", "forward", "float32"): 2,
            ("mm", "backward", "float32"): 10, ("bmm", "backward", "float32"): 4}


def run(metrics: GuardMetrics, steps: int, *faults: GemmFault, policy: Policy | None = None,
        remove_after: int | None = None) -> tuple[list[sdc_guard.StepOutcome], sdc_guard.Guard]:
    """A guarded training loop (``guard.optimizer_step``) with faults injected."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = sdc_guard.SnapshotStore(model, opt, every=1)
    outcomes = []
    with sdc_guard.drill(model, *faults) as drill, \
            sdc_guard.protect(model, metrics=metrics, policy=policy, snapshots=store) as guard:
        for step in range(steps):
            if step == remove_after:
                for fault in faults:
                    drill.remove(fault)
            outcomes.append(guard.optimizer_step(opt, closure_for(model, opt, step)))
    return outcomes, guard


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"rank": "0", **labels})


def counts(registry: CollectorRegistry, name: str, label: str) -> dict[str, float]:
    """label value -> sample value of one labelled counter."""
    return {s.labels[label]: s.value for family in registry.collect() for s in family.samples
            if s.name == name}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require(binary: str) -> str:
    """Path of a Prometheus binary; missing fails under CI and skips elsewhere."""
    path = shutil.which(binary)
    if path is None:
        reason = f"{binary} not on PATH (Debian package 'prometheus'; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: CI must run the Prometheus tests")
        pytest.skip(reason)
    return path


def get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


# --- GuardMetrics on real guarded runs --------------------------------------------------------


def test_transient_fault_run_is_counted_exactly() -> None:
    registry = CollectorRegistry()
    metrics = GuardMetrics(registry, rank=0, budget=0.25)
    before = time.time()
    outcomes, guard = run(metrics, 6, GemmFault(site="blocks.0.attn.qkv", phase="forward", step=3))
    after = time.time()
    assert [o.classification for o in outcomes] == [None, None, None, "transient", None, None]

    assert value(registry, "sdc_guard_steps_total") == 6
    assert value(registry, "sdc_guard_flagged_steps_total") == 1
    assert value(registry, "sdc_guard_reexecutions_total") == 1  # the triage re-run
    for (op, phase, dtype), n in PER_STEP.items():  # first runs only: the re-run is not counted
        kind = {"op": op, "phase": phase, "dtype": dtype}
        assert value(registry, "sdc_guard_gemms_seen_total", **kind) == 6 * n
        assert value(registry, "sdc_guard_gemms_verified_total", **kind) == 6 * n
        assert value(registry, "sdc_guard_gemms_flagged_total", **kind) == (1 if op == "addmm" else 0)
    assert value(registry, "sdc_guard_gemms_unverifiable_total") == 0
    assert counts(registry, "sdc_guard_site_gemms_flagged_total", "site") == {"blocks.0.attn.qkv": 1}
    assert counts(registry, "sdc_guard_detections_total", "classification") == \
        {c: (1 if c == "transient" else 0) for c in CLASSIFICATIONS}
    assert counts(registry, "sdc_guard_responses_total", "action") == \
        {a: (1 if a == "recompute" else 0) for a in ACTIONS}

    reports = list(guard.reports)
    assert len(reports) == 7 and sum(r.attempt for r in reports) == 1
    assert value(registry, "sdc_guard_verify_seconds_total") == pytest.approx(sum(r.verify_seconds for r in reports))
    assert value(registry, "sdc_guard_step_seconds_total") == pytest.approx(sum(r.step_seconds for r in reports))
    assert value(registry, "sdc_guard_step") == 5
    assert value(registry, "sdc_guard_step_flagged") == 0  # the last step was clean
    assert reports[-1].overhead > 0
    assert value(registry, "sdc_guard_overhead_ratio") == pytest.approx(reports[-1].overhead)
    assert value(registry, "sdc_guard_worst_check_ratio") == pytest.approx(reports[-1].worst_ratio)
    assert value(registry, "sdc_guard_overhead_budget_ratio") == 0.25
    assert value(registry, "sdc_guard_last_detection_step") == 3
    assert before <= value(registry, "sdc_guard_last_detection_timestamp_seconds") <= after
    assert before <= value(registry, "sdc_guard_last_report_timestamp_seconds") <= after


def test_clean_run_exports_zeros_and_no_budget_unless_given() -> None:
    registry = CollectorRegistry()
    run(GuardMetrics(registry, rank=0), 2)
    assert value(registry, "sdc_guard_steps_total") == 2
    assert value(registry, "sdc_guard_flagged_steps_total") == 0
    assert value(registry, "sdc_guard_reexecutions_total") == 0
    assert set(counts(registry, "sdc_guard_detections_total", "classification").values()) == {0}
    assert set(counts(registry, "sdc_guard_responses_total", "action").values()) == {0}
    assert value(registry, "sdc_guard_last_detection_step") == -1
    assert value(registry, "sdc_guard_last_detection_timestamp_seconds") == 0
    assert value(registry, "sdc_guard_overhead_budget_ratio") is None
    assert counts(registry, "sdc_guard_site_gemms_flagged_total", "site") == {}


def test_sticky_fault_counts_persistent_and_rollback() -> None:
    registry = CollectorRegistry()
    outcomes, _ = run(GuardMetrics(registry, rank=0), 4, GemmFault(site="head", step=2, sticky=True),
                      remove_after=3)
    assert (outcomes[2].classification, outcomes[2].action) == ("persistent", "rollback")
    assert value(registry, "sdc_guard_steps_total") == 4
    assert value(registry, "sdc_guard_flagged_steps_total") == 1
    # the head's forward addmm and both backward mm (grad input, grad weight), once each
    assert value(registry, "sdc_guard_gemms_flagged_total", op="addmm", phase="forward", dtype="float32") == 1
    assert value(registry, "sdc_guard_gemms_flagged_total", op="mm", phase="backward", dtype="float32") == 2
    assert counts(registry, "sdc_guard_site_gemms_flagged_total", "site") == {"head": 3}
    assert counts(registry, "sdc_guard_detections_total", "classification")["persistent"] == 1
    assert sum(counts(registry, "sdc_guard_detections_total", "classification").values()) == 1
    assert counts(registry, "sdc_guard_responses_total", "action")["rollback"] == 1
    assert sum(counts(registry, "sdc_guard_responses_total", "action").values()) == 1
    assert value(registry, "sdc_guard_last_detection_step") == 2


def test_detections_count_on_the_flagged_rank_and_responses_on_every_rank() -> None:
    registry = CollectorRegistry()
    metrics = GuardMetrics(registry, rank=0)
    outcomes, _ = run(metrics, 1, GemmFault(site="head", phase="forward", step=0),
                      policy=Policy(on_detection="skip"))
    assert (outcomes[0].classification, outcomes[0].action) == ("unconfirmed", "skip")
    # the same step as another rank sees it: rank 1 flagged, this rank (0) only followed
    metrics.observe_outcome(dataclasses.replace(outcomes[0], flagged_ranks=[1]))
    assert counts(registry, "sdc_guard_detections_total", "classification")["unconfirmed"] == 1
    assert counts(registry, "sdc_guard_responses_total", "action")["skip"] == 2


def test_detections_are_counted_by_node_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The series an alert adds up across restarts: this process's node and device, from
    its first report on (at 0), one per detection on this rank."""
    monkeypatch.setenv("SDC_GUARD_NODE", "gpu-node-9")
    registry = CollectorRegistry()
    metrics = GuardMetrics(registry, rank=0)
    name, labels = "sdc_guard_device_detections_total", {"node": "gpu-node-9", "device_id": "cpu"}
    assert value(registry, name, **labels) is None  # the device is not known before a report
    run(metrics, 2)
    assert value(registry, name, **labels) == 0
    run(metrics, 4, GemmFault(site="head", step=1, sticky=True), remove_after=2)  # persistent, rolled back
    run(metrics, 4, GemmFault(site="head", phase="forward", step=1))  # transient
    assert value(registry, name, **labels) == 2
    # another rank's detection is not this device's
    outcome = run(metrics, 1, GemmFault(site="head", phase="forward", step=0), policy=Policy(on_detection="skip"))[0][0]
    metrics.observe_outcome(dataclasses.replace(outcome, flagged_ranks=[1]))
    assert value(registry, name, **labels) == 3
    explicit = CollectorRegistry()
    GuardMetrics(explicit, rank=0, device="cpu")  # a device given: the series exists at once
    assert value(explicit, name, **labels) == 0
    with pytest.raises(ValueError, match="device: expected a torch.device"):
        GuardMetrics(CollectorRegistry(), device="gpu:zero")


def test_flagged_sites_beyond_max_sites_are_labelled_other() -> None:
    registry = CollectorRegistry()
    # every forward addmm corrupted (a moderate bit, so that nothing turns non-finite):
    # five flagged sites against a cap of two
    fault = GemmFault(op="addmm", phase="forward", step=0, sticky=True, bit=26, direction="flip")
    outcomes, _ = run(GuardMetrics(registry, rank=0, max_sites=2), 1, fault, policy=Policy(on_detection="skip"))
    sites = [d.site for d in outcomes[0].report.detections]
    assert sites == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.fc1", "blocks.0.fc2", "head"]
    assert counts(registry, "sdc_guard_site_gemms_flagged_total", "site") == \
        {"blocks.0.attn.qkv": 1, "blocks.0.attn.proj": 1, OTHER_SITE: 3}


def test_arguments_are_checked_and_named() -> None:
    with pytest.raises(ValueError, match="budget"):
        GuardMetrics(budget=0.0)
    with pytest.raises(ValueError, match="rank"):
        GuardMetrics(rank=-1)
    with pytest.raises(TypeError, match="registry"):
        GuardMetrics(registry={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_sites"):
        GuardMetrics(max_sites=-1)
    metrics = GuardMetrics(rank=0)
    with pytest.raises(ValueError, match="port"):
        metrics.serve(port=70000)
    with pytest.raises(ValueError, match="gateway"):
        metrics.push("")
    with pytest.raises(TypeError, match="report"):
        metrics.observe_report("not a report")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="outcome"):
        metrics.observe_outcome(None)  # type: ignore[arg-type]


def test_default_port_is_one_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert default_port() == DEFAULT_PORT == 9464
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_port() == 9467
    monkeypatch.setenv("RANK", "11")
    assert GuardMetrics().rank == 11  # torchrun's RANK, before any process group exists


# --- exposition ----------------------------------------------------------------------------


def test_serve_answers_with_the_metrics_and_a_busy_port_warns_once() -> None:
    registry = CollectorRegistry()
    metrics = GuardMetrics(registry, rank=0)
    url = metrics.serve(port=0)
    try:
        assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        assert metrics.serve(port=0) == url  # serving twice returns the running endpoint
        assert 'sdc_guard_steps_total{rank="0"} 0.0' in get(url)
        run(metrics, 1)
        text = get(url)
        assert 'sdc_guard_steps_total{rank="0"} 1.0' in text
        assert 'sdc_guard_gemms_seen_total{dtype="float32",op="mm",phase="backward",rank="0"} 10.0' in text

        port = int(urllib.parse.urlsplit(url).port)
        other = GuardMetrics(CollectorRegistry(), rank=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert other.serve(port=port) is None
            assert other.serve(port=port) is None
        assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
        assert str(port) in str(caught[0].message)
        run(other, 1)  # training goes on with an exporter that could not serve
        assert other.registry.get_sample_value("sdc_guard_steps_total", {"rank": "1"}) == 1
    finally:
        metrics.close()
    assert metrics.url is None
    with pytest.raises(OSError):
        get(url, timeout=1.0)
    again = GuardMetrics(CollectorRegistry(), rank=0)
    assert again.serve(port=port) is not None  # close() freed the port
    again.close()


def test_push_to_an_unreachable_gateway_warns_once_and_returns_false() -> None:
    metrics = GuardMetrics(CollectorRegistry(), rank=0)
    gateway = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert metrics.push(gateway, job="sdc_guard") is False
        assert metrics.push(gateway, job="sdc_guard") is False
    assert time.monotonic() - started < 5
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert gateway in str(caught[0].message)


class _Gateway(http.server.BaseHTTPRequestHandler):
    """A minimal Pushgateway: records each PUT (path, body) and answers 200."""

    pushes: list[tuple[str, str]] = []

    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        self.pushes.append((self.path, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_push_sends_every_metric_grouped_by_rank_and_again_on_exit() -> None:
    _Gateway.pushes = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registry = CollectorRegistry()
        metrics = GuardMetrics(registry, rank=0)
        gateway = f"http://127.0.0.1:{server.server_port}"
        assert metrics.push(gateway, job="batch") is True
        with pytest.raises(sdc_guard.SDCExit) as info:
            run(metrics, 3, GemmFault(site="head", step=1), policy=Policy(on_detection="exit"))
        assert info.value.code == sdc_guard.EXIT_TRANSIENT
    finally:
        server.shutdown()
        server.server_close()
    assert [path for path, _ in _Gateway.pushes] == ["/metrics/job/batch/rank/0"] * 2
    first, last = (body for _, body in _Gateway.pushes)
    assert 'sdc_guard_steps_total{rank="0"} 0.0' in first
    # the exit response pushed the event that ended the job
    assert 'sdc_guard_responses_total{action="exit",rank="0"} 1.0' in last
    assert 'sdc_guard_detections_total{classification="unconfirmed",rank="0"} 1.0' in last
    assert 'sdc_guard_flagged_steps_total{rank="0"} 1.0' in last


# --- rules, config and dashboard --------------------------------------------------------------


def test_promtool_checks_the_config_and_rules_and_runs_the_rule_tests() -> None:
    promtool = require("promtool")
    tests = sorted(p.name for p in PROM_DIR.glob("*_test.yml"))  # alerts_test.yml, alerts_devices_test.yml
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"],
                 ["test", "rules", *tests]):
        result = subprocess.run([promtool, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    tested = {a for t in tests for a in re.findall(r"alertname: (\w+)", (PROM_DIR / t).read_text())}
    defined = set(re.findall(r"- alert: (\w+)", (PROM_DIR / "alerts.yml").read_text()))
    assert {"SDCDetected", "SDCPersistentFault", "SDCRepeatedOnRank", "SDCGuardOverheadAboveBudget",
            "SDCGuardNotReporting", "SDCGuardAbsent", "SDCGuardScreenMissesHigh", "SDCSuspectDevice",
            "SDCCollectiveLinkRepeated"} == defined == tested


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Sample names GuardMetrics exports (labelled families included before first use)."""
    return {f.name + ("_total" if f.type == "counter" else "") for f in registry.collect()}


def test_rules_and_dashboard_use_only_exported_metrics() -> None:
    registry = CollectorRegistry()
    GuardMetrics(registry, rank=0, budget=0.1)
    names = exported_names(registry)
    texts = {name: (PROM_DIR / name).read_text() for name in ("alerts.yml", "dashboard.json", "README.md")}
    for name, text in texts.items():
        used = set(re.findall(r"\bsdc_guard_[a-z_]+", text)) - {"sdc_guard_pushgateway"}
        assert used and used <= names, f"{name} uses unknown metrics {sorted(used - names)}"
    dashboard = json.loads(texts["dashboard.json"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(p["targets"] and p["gridPos"] for p in dashboard["panels"])
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "job", "rank"}


def dashboard_queries() -> list[str]:
    """The dashboard's PromQL with Grafana's variables filled in as Grafana would."""
    dashboard = json.loads((PROM_DIR / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    fill = {"$job": ".*", "$rank": ".*", "$__rate_interval": "5s", "$__range": "1m"}
    return [re.sub(r"\$\w+", lambda m: fill[m.group(0)], e) for e in exprs]


# --- one real Prometheus ------------------------------------------------------------------------


class Prometheus:
    """A Prometheus server on loopback with its own data directory; HTTP API helpers."""

    def __init__(self, binary: str, tmp: Path, *targets: str) -> None:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(PROM_DIR / "alerts.yml")],
            "scrape_configs": [{"job_name": "sdc_guard", "static_configs": [{"targets": list(targets)}]}],
        }
        (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.base = f"http://127.0.0.1:{free_port()}"
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address={self.base.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        answer = json.loads(get(url))
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> dict[str, float]:
        """Instant query: {rank: value} over the result's series."""
        return {r["metric"].get("rank", ""): float(r["value"][1]) for r in self.api("query", query=expr)["result"]}

    def wait(self, what: str, condition: Any, deadline: float) -> Any:
        """Poll ``condition()`` until truthy; fail naming ``what`` at the deadline."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                result = condition()
            except OSError:  # not listening yet
                result = None
            if result:
                return result
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}; prometheus log:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.corpus  # a real Prometheus server and a training run, 7-11 s (CONTRIBUTING.md)
@pytest.mark.slow
def test_real_prometheus_scrapes_a_training_run_and_fires_the_sdc_alert(tmp_path: Path) -> None:
    binary = require("prometheus")
    metrics = GuardMetrics(CollectorRegistry(), rank=0)
    url = metrics.serve(port=0)
    assert url is not None
    prometheus = Prometheus(binary, tmp_path, urllib.parse.urlsplit(url).netloc)
    deadline = time.monotonic() + 45
    stop = threading.Event()
    failures: list[BaseException] = []
    outcomes: list[sdc_guard.StepOutcome] = []

    def train() -> None:
        """Train until told to stop; a transient fault hits step 3."""
        try:
            model = make_model()
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            with sdc_guard.drill(model, GemmFault(site="blocks.0.fc1", phase="forward", step=3)), \
                    sdc_guard.protect(model, metrics=metrics) as guard:
                for step in range(400):
                    if stop.is_set():
                        break
                    outcomes.append(guard.optimizer_step(opt, closure_for(model, opt, step)))
                    time.sleep(0.05)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    trainer = threading.Thread(target=train, daemon=True)
    try:
        prometheus.wait("prometheus to be ready", lambda: get(f"{prometheus.base}/-/ready"), deadline)
        # a scrape before the fault: the alert must fire on the counter's increase
        prometheus.wait("the first scrape of the exporter",
                        lambda: prometheus.query("sdc_guard_flagged_steps_total") == {"0": 0.0}, deadline)
        trainer.start()

        def sdc_alert() -> dict | None:
            alerts = prometheus.api("alerts")["alerts"]
            return next((a for a in alerts if a["labels"]["alertname"] == "SDCDetected"
                         and a["state"] == "firing"), None)

        alert = prometheus.wait("SDCDetected to fire", sdc_alert, deadline)
        stop.set()
        trainer.join(timeout=30)
        assert not failures, failures
        assert outcomes[3].classification == "transient" and outcomes[3].action == "recompute"

        assert alert["labels"] == {"alertname": "SDCDetected", "severity": "warning", "job": "sdc_guard",
                                   "instance": urllib.parse.urlsplit(url).netloc, "rank": "0"}
        detections = 'sdc_guard_detections_total{job="sdc_guard", classification="transient"}'
        assert prometheus.wait("the detection counter", lambda: prometheus.query(detections), deadline) == {"0": 1.0}
        assert prometheus.query('sdc_guard_responses_total{action="recompute"}') == {"0": 1.0}
        assert prometheus.query("sdc_guard_flagged_steps_total") == {"0": 1.0}
        assert prometheus.query("sdc_guard_steps_total")["0"] >= 4
        firing = {a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"] if a["state"] == "firing"}
        assert firing == {"SDCDetected"}  # not persistent, not repeated, not absent

        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        defined = re.findall(r"- alert: (\w+)", (PROM_DIR / "alerts.yml").read_text())
        assert len(rules) == len(defined) and all(r["health"] == "ok" for r in rules), rules
        for expr in dashboard_queries():  # the dashboard's queries are valid PromQL here
            prometheus.api("query", query=expr)
    finally:
        stop.set()
        if trainer.is_alive():
            trainer.join(timeout=30)
        prometheus.stop()
        metrics.close()


@pytest.mark.corpus  # a real Prometheus server and a training run, 7-11 s (CONTRIBUTING.md)
@pytest.mark.slow
def test_real_prometheus_names_the_suspect_device_across_a_restart(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs on one node and device, one after the other, as a job and its restart on
    another rank (each with its own endpoint): a transient fault in each. Neither run
    alone is repeated on its rank; SDCSuspectDevice adds them up and names the device."""
    binary = require("prometheus")
    monkeypatch.setenv("SDC_GUARD_NODE", "gpu-node-9")
    runs = [GuardMetrics(CollectorRegistry(), rank=rank) for rank in (0, 3)]
    urls = [m.serve(port=0) for m in runs]
    assert all(urls)
    targets = [urllib.parse.urlsplit(u).netloc for u in urls]
    prometheus = Prometheus(binary, tmp_path, *targets)
    deadline = time.monotonic() + 60
    device = 'sdc_guard_device_detections_total{node="gpu-node-9", device_id="cpu"}'

    def train(metrics: GuardMetrics) -> None:
        """Train until Prometheus has scraped this run's detection (at step 2)."""
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with sdc_guard.drill(model, GemmFault(site="blocks.0.fc1", phase="forward", step=2)), \
                sdc_guard.protect(model, metrics=metrics) as guard:
            for step in range(400):
                guard.optimizer_step(opt, closure_for(model, opt, step))
                if prometheus.query(device).get(str(metrics.rank)) == 1.0:
                    return
                time.sleep(0.05)
        pytest.fail(f"the detection was never scraped: {prometheus.query(device)}")

    def suspect() -> dict | None:
        return next((a for a in prometheus.api("alerts")["alerts"]
                     if a["labels"]["alertname"] == "SDCSuspectDevice" and a["state"] == "firing"), None)

    try:
        prometheus.wait("prometheus to be ready", lambda: get(f"{prometheus.base}/-/ready"), deadline)
        prometheus.wait("both targets scraped", lambda: prometheus.query('count(up{job="sdc_guard"} == 1)') == {"": 2.0},
                        deadline)
        train(runs[0])
        runs[0].close()  # the first run exits; its series go stale
        time.sleep(2)
        assert suspect() is None  # one detection on the device so far
        train(runs[1])
        alert = prometheus.wait("SDCSuspectDevice to fire", suspect, deadline)
        assert alert["labels"] == {"alertname": "SDCSuspectDevice", "severity": "critical",
                                   "node": "gpu-node-9", "device_id": "cpu"}
        assert float(alert["value"]) == 2.0
        firing = {a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"] if a["state"] == "firing"}
        assert "SDCRepeatedOnRank" not in firing  # one flagged step on each rank
    finally:
        prometheus.stop()
        for metrics in runs:
            metrics.close()
