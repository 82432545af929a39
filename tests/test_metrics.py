from __future__ import annotations

import re

import pytest

from warmcap.errors import ConfigError
from warmcap.metrics import SpecDecodeMetrics, format_spec_stats

_SAMPLE = re.compile(r"^(?P<name>[a-z_:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def _parse(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """Prometheus text exposition -> (TYPE per metric, value per (name, labels))."""
    types: dict[str, str] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4, f"HELP without text: {line!r}"
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
            assert m["name"] in types, f"sample before its TYPE line: {line!r}"
            samples[(m["name"], labels)] = float(m["value"])
    return types, samples


def _observed() -> SpecDecodeMetrics:
    m = SpecDecodeMetrics()
    for drafted, accepted in [(3, 3), (3, 1), (3, 0), (2, 2), (0, 0)]:
        m.observe(drafted, accepted)
    return m


def test_counters_and_acceptance_length() -> None:
    m = _observed()
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (4, 11, 6)
    assert m.accepted_per_pos == [3, 2, 1]
    assert m.acceptance_length == pytest.approx(1 + 6 / 4)
    assert m.acceptance_rate == pytest.approx(6 / 11)
    assert m.per_position_rates == pytest.approx([0.75, 0.5, 0.25])


def test_empty_metrics_are_neutral() -> None:
    m = SpecDecodeMetrics()
    assert m.acceptance_length == 1.0
    assert m.acceptance_rate == 0.0
    assert "no drafts" in format_spec_stats(m)


def test_impossible_observation_is_rejected() -> None:
    with pytest.raises(ValueError):
        SpecDecodeMetrics().observe(2, 3)


def test_prometheus_exposition_round_trips() -> None:
    types, samples = _parse(_observed().to_prometheus({"model_name": "tiny"}))
    base = frozenset({("model_name", "tiny")})
    assert types == {
        "vllm:spec_decode_num_drafts_total": "counter",
        "vllm:spec_decode_num_draft_tokens_total": "counter",
        "vllm:spec_decode_num_accepted_tokens_total": "counter",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": "counter",
    }
    assert samples[("vllm:spec_decode_num_drafts_total", base)] == 4
    assert samples[("vllm:spec_decode_num_draft_tokens_total", base)] == 11
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", base)] == 6
    per_pos = {
        dict(labels)["position"]: value
        for (name, labels), value in samples.items()
        if name.endswith("per_pos_total")
    }
    assert per_pos == {"0": 3, "1": 2, "2": 1}


def test_prometheus_without_labels_and_reserved_label() -> None:
    _, samples = _parse(_observed().to_prometheus())
    assert samples[("vllm:spec_decode_num_drafts_total", frozenset())] == 4
    assert (
        samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", frozenset({("position", "0")}))] == 3
    )
    with pytest.raises(ConfigError):
        _observed().to_prometheus({"position": "x"})


def test_merge_adds_counts_and_as_dict_matches() -> None:
    total = SpecDecodeMetrics()
    total.merge(_observed())
    step = SpecDecodeMetrics()
    step.observe(5, 4)
    total.merge(step)
    d = total.as_dict()
    assert d["num_drafts"] == 5 and d["num_draft_tokens"] == 16 and d["num_accepted_tokens"] == 10
    assert d["accepted_per_pos"] == [4, 3, 2, 1, 0]
    assert d["acceptance_length"] == pytest.approx(3.0)


def test_format_spec_stats_mentions_the_numbers() -> None:
    text = format_spec_stats(_observed())
    assert "2.50" in text and "6/11" in text and "0.75 0.50 0.25" in text


def test_collector_has_every_position_from_the_start_and_follows_its_source() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from warmcap.metrics import SpecDecodeCollector

    live = SpecDecodeMetrics()
    registry = CollectorRegistry()
    registry.register(SpecDecodeCollector(lambda: live, {"model_name": "m"}, num_positions=3))
    base = frozenset({("model_name", "m")})
    _, samples = _parse(generate_latest(registry).decode())
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [samples[(per_pos, base | {("position", str(p))})] for p in range(3)] == [0, 0, 0]
    assert samples[("vllm:spec_decode_num_drafts_total", base)] == 0
    live.observe(3, 2)
    _, samples = _parse(generate_latest(registry).decode())
    assert [samples[(per_pos, base | {("position", str(p))})] for p in range(3)] == [1, 1, 0]
    assert 1 + samples[("vllm:spec_decode_num_accepted_tokens_total", base)] / samples[
        ("vllm:spec_decode_num_drafts_total", base)
    ] == pytest.approx(live.acceptance_length)
