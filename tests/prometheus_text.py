"""Prometheus' text format read back with its own parser, for tests that scrape `/metrics`."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample by (name, labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(scraped: Samples, name: str, **labels: str) -> float:
    return scraped[(name, frozenset(labels.items()))]
