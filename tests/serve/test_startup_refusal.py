"""Why ``warmup serve`` refuses to become ready, in the one line it exits with: the server is gone
by then, so the line itself must name what failed (no ``GET /startup`` to read)."""

from __future__ import annotations

from types import SimpleNamespace

from warmcap.serve.startup_facts import StartupFacts, _refusal, _unverified


def _facts(captured: int, unverified: tuple[str, ...]) -> StartupFacts:
    return StartupFacts(
        phase_seconds={},
        graphs_captured=captured,
        graphs_verified=captured - len(unverified),
        audit_slots_checked=10,
        audit_violations=0,
        violation_samples=(),
        unverified_graphs=unverified,
    )


def test_a_clean_start_is_not_refused():
    assert _refusal(_facts(5, ())) is None


def test_the_refusal_names_the_graphs_that_failed_and_what_to_do():
    graph = SimpleNamespace(label="decode FULL t=116 r=116 q=1", max_abs_diff=0.0, greedy_match=False)
    line = _refusal(_facts(163, (_unverified(graph),)))
    assert line is not None and "\n" not in line
    assert line.startswith("1 of 163 captured graph(s) do not replay like eager")
    assert "decode FULL t=116 r=116 q=1: max |replay - eager| 0, greedy tokens differ" in line
    assert "leave out --capture-graphs" in line and "GET /startup" not in line


def test_many_failures_are_cut_to_three_names():
    names = tuple(f"decode FULL t={n} r={n} q=1: not verified" for n in range(1, 6))
    line = _refusal(_facts(10, names))
    assert line is not None and "t=3 " in line and "t=4 " not in line and line.count("; ...") == 1
