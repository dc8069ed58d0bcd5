"""The fleet's directory: a small Ray actor each replica reports to every second (its
residency, queue, where requests landed, its Prometheus text), which the ingress reads for
`/fleet` and `/metrics`. A replica that stops reporting (it died) leaves the listing after
STALE_S; Ray starts its successor, which reports under its own id."""

from __future__ import annotations

import time

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

NAMESPACE = "mox"
STALE_S = 5.0
REPORT_PERIOD_S = 1.0


@ray.remote(num_cpus=0)
class FleetDirectory:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict]] = {}

    def report(self, replica: str, report: dict) -> dict[str, dict]:
        """Takes a replica's report; returns every live replica's warmth (where a model is
        warm across the fleet, for the replica's landing counts)."""
        self._reports[replica] = (time.monotonic(), report)
        return {r: {"warmth": rep.get("warmth", {})} for r, rep in self.reports().items()}

    def reports(self) -> dict[str, dict]:
        now = time.monotonic()
        self._reports = {r: (t, rep) for r, (t, rep) in self._reports.items()
                         if now - t < STALE_S}
        return {r: rep for r, (_, rep) in self._reports.items()}


def directory(app_name: str):
    """The app's directory actor, created by whichever part asks first. Detached, so it does
    not die with the replica that created it; `mox serve --ray` kills it on the way out."""
    return FleetDirectory.options(name=f"fleet-{app_name}", namespace=NAMESPACE,
                                  get_if_exists=True, lifetime="detached").remote()


class _Families:
    """prometheus_client collector over already-built families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Each replica's Prometheus text -> one exposition, every sample labelled with its
    `replica` (one HELP and TYPE per family)."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value,
                                  s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
