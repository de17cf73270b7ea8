"""Prometheus export of step reports and responses: what pages a human on an SDC event.

``GuardMetrics`` is the guard's metrics sink (``protect(model, metrics=GuardMetrics())``):
the guard hands it every closed ``StepReport`` (re-executions included, as
``attempt > 0``) and every ``StepOutcome`` of ``guard.optimizer_step``. It keeps them as
``prometheus_client`` metrics on its own ``CollectorRegistry`` (injectable), and exposes
them by HTTP (``serve``, for long jobs that Prometheus scrapes) or by pushing to a
Pushgateway (``push``, for short or batch jobs that may end between two scrapes).

Metrics (every one carries a constant ``rank`` label; counters count from 0 so that
``increase()`` sees the first event):

=============================================  =========  ================================
name                                           type       labels besides ``rank``
=============================================  =========  ================================
``sdc_guard_steps_total``                      counter    steps reported (first runs)
``sdc_guard_flagged_steps_total``              counter    steps whose first run flagged
``sdc_guard_reexecutions_total``               counter    re-runs of a step for triage
``sdc_guard_gemms_seen_total``                 counter    op, phase, dtype
``sdc_guard_gemms_verified_total``             counter    op, phase, dtype
``sdc_guard_gemms_flagged_total``              counter    op, phase, dtype
``sdc_guard_gemms_unverifiable_total``         counter    GEMM-bearing ops not verifiable
``sdc_guard_site_gemms_flagged_total``         counter    site (``max_sites`` + "other")
``sdc_guard_detections_total``                 counter    classification
``sdc_guard_device_detections_total``          counter    node, device_id (this process's)
``sdc_guard_responses_total``                  counter    action
``sdc_guard_screen_misses_total``              counter    suspects the confirmation cleared
``sdc_guard_segments_checked_total``           counter    (row, segment)s screened
``sdc_guard_gradient_screen_trips_total``      counter    steps the gradient screen tripped
``sdc_guard_gradient_screen_misses_total``     counter    trips whose re-execution was clean
                                                          and identical (not acted on)
``sdc_guard_gradient_screen_ratio``            gauge      last step's worst norm/reference
``sdc_guard_collective_checks_total``          counter    op: collectives checked (first runs)
``sdc_guard_collective_detections_total``      counter    op, link ("src->dst"; "*->dst" for
                                                          a reduction: every rank sends)
``sdc_guard_collectives_unchecked_total``      counter    op: collectives not checked, with why
``sdc_guard_verify_seconds_total``             counter    verification time, all runs
``sdc_guard_guard_seconds_total``              counter    all the guard added, all runs
``sdc_guard_calibration_seconds_total``        counter    the part calibration replays took
``sdc_guard_step_seconds_total``               counter    step wall time, all runs
``sdc_guard_step``                             gauge      number of the last step
``sdc_guard_step_flagged``                     gauge      1 if the last step flagged
``sdc_guard_overhead_ratio``                   gauge      last step's guard overhead
``sdc_guard_overhead_calibrated``              gauge      1: that is the whole cost, measured
``sdc_guard_verify_overhead_ratio``            gauge      last step's verification overhead
``sdc_guard_overhead_budget_ratio``            gauge      the budget (only if given)
``sdc_guard_worst_check_ratio``                gauge      last step's largest screen D/T
``sdc_guard_last_detection_step``              gauge      -1 until a detection
``sdc_guard_last_detection_timestamp_seconds`` gauge      unix time; 0 until a detection
``sdc_guard_last_report_timestamp_seconds``    gauge      unix time of the last report
=============================================  =========  ================================

Choices, and why:

- GEMM and step counters count a step's first run only, so ``verified / seen`` is the
  sampler's coverage and one corrupted GEMM counts once; re-executions (which verify
  everything) are counted apart, and their time is in the seconds counters, because it
  is real cost. Long-run overhead is ``rate(guard) / (rate(step) - rate(guard))`` (the
  guard's whole cost: interception, bookkeeping, verification, calibration replays),
  which is what the alert on the budget uses; the per-step gauges are for dashboards (a
  step that ran a calibration replay shows its cost: about one more unguarded run).
  Interception is measured by the replays (``sdc_guard.runtime.lifecycle.calibration``);
  ``sdc_guard_overhead_calibrated`` is 0 while it is still the per-op estimate, a lower
  bound (observation-only blocks, ``calibrate_every=None``, before the first replay).
- Detections are counted on the rank(s) whose GEMMs flagged (``outcome.flagged_ranks``)
  or whose gradient screen tripped (``outcome.tripped_ranks``) into a confirmed detection;
  responses on every rank, since every rank takes the response in lockstep.
- Collectives (``runtime/collectives/collective_checks.py``) are counted by op; a detection by op and
  link, on the receiving rank, the first ``max_sites`` distinct links by name and the rest
  as ``"other"``: an all-gather's link names the sending rank (``"3->0"``), a reduction's
  does not (``"*->0"``: every rank of the group sent into it). A collective detection
  also counts as a flagged step (``SDCDetected``), not as a flagged GEMM.
- A rank moves to another node when a job restarts; a device does not. So detections are
  also counted by device: ``sdc_guard_device_detections_total`` carries the node and
  device (``respond.identity``: the device's UUID where the runtime tells it, else its
  name on the node) of this process, which lets the ``SDCSuspectDevice`` alert add up one
  device's detections across restarts, whichever rank and job had it.
- Sites (module paths) are unbounded in general, so they label only the flagged-GEMM
  counter, the first ``max_sites`` distinct flagged sites by name and the rest as
  ``"other"``; detections are rare, so in practice every flagged site keeps its name.
- One port per local rank: ``serve()`` defaults to ``DEFAULT_PORT + LOCAL_RANK``.
  Each process of a multi-process job has its own registry and endpoint (no
  ``prometheus_client`` multiprocess mode); the ``rank`` label tells them apart.
- A metrics failure (port in use, Pushgateway unreachable) warns once and returns a
  falsy value; it never interrupts training. Arguments that cannot be right (a port
  of 70000) still raise ``ValueError`` at once, naming the argument.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, push_to_gateway

import torch

from .respond import distributed
from .respond.identity import local_identity
from .report import StepReport
from .respond.policy import ACTIONS, CLASSIFICATIONS, StepOutcome
from .runtime.dispatch.collective_ops import OPS as COLLECTIVE_OPS
from .report import Detection
from .metrics_server import DEFAULT_PORT, default_port, start_http_server  # noqa: F401  (also importable here)

#: Label value of flagged sites beyond ``max_sites``.
OTHER_SITE = "other"


def _resolve_rank(rank: int | None) -> int:
    if rank is None:
        if distributed.is_distributed():
            return distributed.rank()
        try:  # torchrun sets RANK before init_process_group
            return max(int(os.environ.get("RANK", "0")), 0)
        except ValueError:
            return 0
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank: expected a non-negative int or None, got {rank!r}")
    return rank


def _check_budget(budget: float | None) -> float | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < math.inf:
        raise ValueError(f"budget: expected a positive overhead fraction (0.05 = 5 %) or None, got {budget!r}")
    return float(budget)


class GuardMetrics:
    """Prometheus metrics of a guarded job; a ``MetricsSink`` for ``protect(metrics=...)``.

    Args:
        registry: where the metrics live. Default: a new private ``CollectorRegistry``,
            so that two instances in one process (two ``fit`` calls) never collide; pass
            ``prometheus_client.REGISTRY`` to export through an endpoint you already run.
        rank: the constant ``rank`` label. Default: the ``torch.distributed`` rank if a
            process group exists, else ``$RANK``, else 0.
        budget: the overhead budget (``sampling.Budget.max_overhead``), exported as
            ``sdc_guard_overhead_budget_ratio`` for the alert on overhead; ``None`` exports
            no budget and that alert stays silent.
        max_sites: distinct flagged sites labelled by name; later ones count as "other".
        device: the device whose detections ``sdc_guard_device_detections_total`` counts.
            Default: resolved at the first report (``identity.default_device()``: the
            current CUDA device once CUDA is initialised, else the CPU).

    >>> import torch, sdc_guard
    >>> from prometheus_client import CollectorRegistry
    >>> registry = CollectorRegistry()
    >>> model = torch.nn.Linear(4, 2)
    >>> with sdc_guard.protect(model, metrics=GuardMetrics(registry, rank=0)):
    ...     model(torch.randn(3, 4)).sum().backward()
    >>> registry.get_sample_value("sdc_guard_steps_total", {"rank": "0"})
    1.0
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        rank: int | None = None,
        budget: float | None = None,
        max_sites: int = 32,
        device: torch.device | str | None = None,
    ) -> None:
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry: expected a prometheus_client.CollectorRegistry or None, "
                            f"got {type(registry).__name__}")
        if isinstance(max_sites, bool) or not isinstance(max_sites, int) or max_sites < 0:
            raise ValueError(f"max_sites: expected a non-negative int, got {max_sites!r}")
        if device is not None:
            try:
                device = torch.device(device)
            except (TypeError, RuntimeError):
                raise ValueError(f"device: expected a torch.device, a device name such as 'cuda:0', or None, "
                                 f"got {type(device).__name__} {device!r}") from None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rank = _resolve_rank(rank)
        self.budget = _check_budget(budget)
        self.max_sites = max_sites
        self.url: str | None = None  #: the endpoint of ``serve()``, once it runs
        self._server: Any = None
        self._push_target: dict[str, Any] | None = None
        self._warned: set[str] = set()
        self._sites: set[str] = set()
        self._links: set[str] = set()
        self._device = device
        self._device_series: Any = None  #: this process's child of the device counter, once resolved
        self._create()
        if device is not None:
            self._device_counter()

    # --- metric definitions --------------------------------------------------------------

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, ("rank", *labels), registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ("rank",), registry=self.registry).labels(rank=str(self.rank))

    def _create(self) -> None:
        r = str(self.rank)
        c = self._counter
        self._steps = c("sdc_guard_steps", "Guarded steps reported (first runs).").labels(rank=r)
        self._flagged_steps = c("sdc_guard_flagged_steps",
                                "Steps whose first run flagged at least one GEMM on this rank.").labels(rank=r)
        self._reexecutions = c("sdc_guard_reexecutions", "Re-executions of a step for triage.").labels(rank=r)
        kind = ("op", "phase", "dtype")
        self._gemms_seen = c("sdc_guard_gemms_seen", "GEMMs seen (first runs).", *kind)
        self._gemms_verified = c("sdc_guard_gemms_verified", "GEMMs verified (first runs).", *kind)
        self._gemms_flagged = c("sdc_guard_gemms_flagged",
                                "GEMMs whose check found corruption, confirmed exactly (first runs).", *kind)
        self._screen_misses = c("sdc_guard_screen_misses",
                                "(row, segment)s the screen flagged that the exact confirmation cleared "
                                "(a clean product suspected; never acted on), re-executions included.").labels(rank=r)
        self._segments = c("sdc_guard_segments_checked",
                           "(row, segment)s the screen checked, re-executions included.").labels(rank=r)
        self._gradient_trips = c("sdc_guard_gradient_screen_trips",
                                 "Steps whose gradient screen (sampling.Screened) tripped on this rank: "
                                 "each was re-executed with every GEMM verified.").labels(rank=r)
        self._gradient_misses = c("sdc_guard_gradient_screen_misses",
                                  "Gradient-screen trips whose verified re-execution was clean and identical to "
                                  "the first run (a legitimately unusual step; not acted on), on every rank.").labels(rank=r)
        self._gemms_unverifiable = c("sdc_guard_gemms_unverifiable",
                                     "GEMM-bearing ops that could not be verified (first runs).").labels(rank=r)
        self._site_flagged = c("sdc_guard_site_gemms_flagged",
                               f"Flagged GEMMs by module path (first {self.max_sites} sites, then 'other').", "site")
        self._detections = c("sdc_guard_detections", "Detections on this rank by triage classification.",
                             "classification")
        self._responses = c("sdc_guard_responses", "Responses taken (on every rank, in lockstep).", "action")
        self._device_detections = c("sdc_guard_device_detections",
                                    "Detections on this process's device, by node and device (its UUID where "
                                    "known): summed across restarts by the SDCSuspectDevice alert.",
                                    "node", "device_id")
        self._verify_seconds = c("sdc_guard_verify_seconds",
                                 "Verification time, re-executions included.").labels(rank=r)
        self._guard_seconds = c("sdc_guard_guard_seconds",
                                "Everything the guard added to steps (interception, bookkeeping, verification, "
                                "calibration replays; interception measured by the replays, or estimated per op "
                                "where sdc_guard_overhead_calibrated is 0), re-executions included.").labels(rank=r)
        self._calibration_seconds = c("sdc_guard_calibration_seconds",
                                      "Time calibration replays took (the closure run bare to measure "
                                      "interception; part of sdc_guard_guard_seconds_total).").labels(rank=r)
        self._step_seconds = c("sdc_guard_step_seconds",
                               "Guarded step wall time, re-executions included.").labels(rank=r)
        self._collective_checks = c("sdc_guard_collective_checks",
                                    "Collectives whose result this rank checked against what was sent "
                                    "(first runs), by op.", "op")
        self._collective_detections = c("sdc_guard_collective_detections",
                                        "Collectives whose result on this rank was not what was sent (first runs), "
                                        "by op and link ('src->dst'; '*->dst' for a reduction).", "op", "link")
        self._collectives_unchecked = c("sdc_guard_collectives_unchecked",
                                        "Collectives seen but not checked (first runs), by 'op[reason]'.", "op")
        for name in COLLECTIVE_OPS:
            self._collective_checks.labels(rank=r, op=name)
        for name in CLASSIFICATIONS:  # start at 0: increase() must see the first one
            self._detections.labels(rank=r, classification=name)
        for name in ACTIONS:
            self._responses.labels(rank=r, action=name)

        g = self._gauge
        self._step = g("sdc_guard_step", "Number of the last step reported.")
        self._step_flagged = g("sdc_guard_step_flagged", "1 if the last step flagged a GEMM, else 0.")
        self._overhead = g("sdc_guard_overhead_ratio",
                           "What the guard added / step time without it (interception, bookkeeping, verification, "
                           "a calibration replay if the step ran one), last step.")
        self._overhead_calibrated = g("sdc_guard_overhead_calibrated",
                                      "1 if the last step's overhead is the guard's whole cost, measured (interception "
                                      "calibrated by paired replays); 0 if interception is the per-op estimate, a "
                                      "lower bound.")
        self._verify_overhead = g("sdc_guard_verify_overhead_ratio",
                                  "Verification time alone / step time without it, last step.")
        self._worst_ratio = g("sdc_guard_worst_check_ratio",
                              "Largest screen D/T of the last step's verified GEMMs (above 1: the screen flagged; "
                              "only a confirmed flag is a detection).")
        self._gradient_ratio = g("sdc_guard_gradient_screen_ratio",
                                 "Largest per-parameter gradient norm over its reference at the last screened step "
                                 "(above the screen's factor: it tripped).")
        self._last_detection_step = g("sdc_guard_last_detection_step", "Step of the last detection (-1: none).")
        self._last_detection_step.set(-1)
        self._last_detection_time = g("sdc_guard_last_detection_timestamp_seconds",
                                      "Unix time of the last detection (0: none).")
        self._last_report_time = g("sdc_guard_last_report_timestamp_seconds", "Unix time of the last report.")
        if self.budget is not None:
            g("sdc_guard_overhead_budget_ratio", "The guard's overhead budget.").set(self.budget)

    # --- MetricsSink -----------------------------------------------------------------------

    def observe_report(self, report: StepReport) -> None:
        """Count one closed step (a re-execution when ``report.attempt > 0``).

        Called by the guard; call it yourself only for reports you build elsewhere.
        """
        if not isinstance(report, StepReport):
            raise TypeError(f"report: expected a sdc_guard.StepReport, got {type(report).__name__}")
        now = time.time()
        self._device_counter()  # the series exists from the first report on, at 0
        self._verify_seconds.inc(max(report.verify_seconds, 0.0))
        self._guard_seconds.inc(max(report.guard_seconds, 0.0))
        self._calibration_seconds.inc(max(report.calibration_seconds, 0.0))
        self._step_seconds.inc(max(report.step_seconds, 0.0))
        self._screen_misses.inc(max(report.screen_misses, 0))
        self._segments.inc(max(report.segments, 0))
        self._last_report_time.set(now)
        if report.attempt > 0:
            self._reexecutions.inc()
            return
        r = str(self.rank)
        self._steps.inc()
        self._step.set(report.step)
        self._step_flagged.set(1 if report.flagged else 0)
        self._overhead.set(report.overhead)
        self._overhead_calibrated.set(1 if report.overhead_calibrated else 0)
        self._verify_overhead.set(report.verify_overhead)
        self._worst_ratio.set(report.worst_ratio)
        if report.gradient_screened:
            self._gradient_ratio.set(report.gradient_ratio)
            if report.gradient_screen_tripped:
                self._gradient_trips.inc()
        self._gemms_unverifiable.inc(sum(report.unverified_ops.values()))
        for (op, phase, dtype), counts in report.by_kind.items():
            labels = {"rank": r, "op": op, "phase": phase, "dtype": dtype}
            self._gemms_seen.labels(**labels).inc(counts.seen)
            self._gemms_verified.labels(**labels).inc(counts.verified)
            self._gemms_flagged.labels(**labels).inc(counts.flagged)
        for op, count in report.collective_checks_by_op.items():
            self._collective_checks.labels(rank=r, op=op).inc(count)
        for op, count in report.collectives_unchecked.items():
            self._collectives_unchecked.labels(rank=r, op=op).inc(count)
        if report.flagged:
            self._flagged_steps.inc()
            self._last_detection_step.set(report.step)
            self._last_detection_time.set(now)
            for detection in report.detections:
                if detection.kind == "collective":
                    for link in self._link_labels(detection):
                        self._collective_detections.labels(rank=r, op=detection.op, link=link).inc()
                else:
                    self._site_flagged.labels(rank=r, site=self._site_label(detection.site)).inc()

    def observe_outcome(self, outcome: StepOutcome) -> None:
        """Count the response to one guarded optimizer step (nothing when it was clean).

        An ``exit`` or ``raise`` response ends training: if ``push()`` was used, the
        metrics are pushed once more now, so the event outlives the process.
        """
        if not isinstance(outcome, StepOutcome):
            raise TypeError(f"outcome: expected a sdc_guard.StepOutcome, got {type(outcome).__name__}")
        r = str(self.rank)
        rank = outcome.report.rank
        if outcome.classification is not None and (rank in outcome.flagged_ranks or rank in outcome.tripped_ranks):
            self._detections.labels(rank=r, classification=outcome.classification).inc()
            self._device_counter().inc()
        if outcome.screen == "miss":
            self._gradient_misses.inc()
        if outcome.action is not None:
            self._responses.labels(rank=r, action=outcome.action).inc()
        if outcome.action in ("exit", "raise") and self._push_target is not None:
            self.push(**self._push_target)

    def _link_labels(self, detection: Detection) -> list[str]:
        """One link per sender of an all-gather's bad shards; ``"*->dst"`` for a reduction
        (or the exchange), whose every rank sent into the result."""
        receiver = detection.receiver if detection.receiver is not None else detection.rank
        senders = [str(s) for s in detection.senders] if detection.op == "all_gather" else ["*"]
        labels = []
        for sender in senders or ["*"]:
            link = f"{sender}->{receiver}"
            if link not in self._links and len(self._links) < self.max_sites:
                self._links.add(link)
            labels.append(link if link in self._links else OTHER_SITE)
        return labels

    def _device_counter(self) -> Any:
        """This process's child of ``sdc_guard_device_detections_total`` (created at 0 the
        first time, when the device is known)."""
        if self._device_series is None:
            ident = local_identity(self._device)
            self._device_series = self._device_detections.labels(rank=str(self.rank), node=ident.node,
                                                                 device_id=ident.device_id)
        return self._device_series

    def _site_label(self, site: str) -> str:
        if site in self._sites:
            return site
        if len(self._sites) < self.max_sites:
            self._sites.add(site)
            return site
        return OTHER_SITE

    # --- exposition --------------------------------------------------------------------------

    def serve(self, address: str = "127.0.0.1", port: int | None = None) -> str | None:
        """Serve the metrics over HTTP for Prometheus to scrape; returns the URL.

        ``port`` defaults to ``default_port()`` (9464 + ``$LOCAL_RANK``); 0 picks a free
        port. Bound to loopback unless ``address`` says otherwise ("0.0.0.0" for a
        Prometheus on another host). A port in use warns once and returns ``None``:
        training goes on unmonitored rather than not at all. Serving twice returns the
        running endpoint.

        >>> metrics = GuardMetrics(rank=0)
        >>> url = metrics.serve(port=0); url.startswith("http://127.0.0.1:")
        True
        >>> metrics.close()
        """
        if not isinstance(address, str) or not address:
            raise ValueError(f"address: expected a host name or IP address, got {address!r}")
        port = default_port() if port is None else port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port: expected an int in 0..65535 or None, got {port!r}")
        if self._server is not None:
            return self.url
        try:
            server = start_http_server(address, port, self.registry)
        except OSError as exc:
            self._warn_once("serve", f"sdc_guard: cannot serve metrics on {address}:{port} ({exc}); "
                                     "training continues without a metrics endpoint")
            return None
        self._server = server
        host = f"[{address}]" if ":" in address else address
        self.url = f"http://{host}:{server.server_port}/metrics"
        return self.url

    def close(self) -> None:
        """Stop the HTTP endpoint (if any) and free its port; the metrics stay readable."""
        server, self._server, self.url = self._server, None, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def push(self, gateway: str, job: str = "sdc_guard", grouping_key: dict[str, str] | None = None,
             *, timeout: float = 5.0) -> bool:
        """Push all metrics to a Pushgateway (replacing this group's); True on success.

        For jobs too short for scrapes: push at the end (and, if you like, every N steps).
        The group defaults to ``{"rank": <rank>}`` so the ranks of one job do not
        overwrite each other. Remembered: an ``exit`` or ``raise`` response pushes again.
        An unreachable or failing gateway warns once (until a push succeeds again) and
        returns False within ``timeout`` seconds; it never raises.

        >>> GuardMetrics(rank=0).push("http://127.0.0.1:1", timeout=1.0)  # doctest: +SKIP
        False
        """
        if not isinstance(gateway, str) or not gateway:
            raise ValueError(f"gateway: expected a Pushgateway address such as 'http://host:9091', got {gateway!r}")
        if not isinstance(job, str) or not job:
            raise ValueError(f"job: expected a non-empty job name, got {job!r}")
        if grouping_key is not None and not isinstance(grouping_key, dict):
            raise ValueError(f"grouping_key: expected a dict of label names to values or None, got {grouping_key!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        key = {"rank": str(self.rank)} if grouping_key is None else {k: str(v) for k, v in grouping_key.items()}
        self._push_target = {"gateway": gateway, "job": job, "grouping_key": key, "timeout": timeout}
        try:
            push_to_gateway(gateway, job=job, registry=self.registry, grouping_key=key, timeout=timeout)
        except Exception as exc:  # a monitoring failure never stops training
            self._warn_once("push", f"sdc_guard: cannot push metrics to {gateway} ({type(exc).__name__}: "
                                    f"{exc}); training continues")
            return False
        self._warned.discard("push")  # the next outage warns again, once
        return True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
