"""``warmup plan --html``: the page shows the plan's own numbers, one cell per block-table entry,
and each step's shape and graph; it is one file with nothing to fetch."""

from __future__ import annotations

import json

import pytest
from page_dom import Page, check_numbers, network_references
from typer.testing import CliRunner

from warmcap.cli import app
from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.core.kv_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from warmcap.graphs.capture.planning import CaptureFacts, plan_capture
from warmcap.pages.plan_page import plan_page, plan_view
from warmcap.pages.shapes import graph_for, planned_graphs, step_shape
from warmcap.runner_v2.attention.torch_paged import TorchPagedAttention
from warmcap.warmup.planner import plan_warmup

runner = CliRunner()
PLAN_ARGS = ["plan", "--model", "tiny-llama", "--spec", "eagle3:3", "--num-blocks", "64"]


def _plan_json_and_page(tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "plan.html"
    res = runner.invoke(app, [*PLAN_ARGS, *extra, "--html", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(runner.invoke(app, [*PLAN_ARGS, *extra, "--json"]).output)
    return data, out.read_text()


def test_plan_page_shows_the_json_plans_numbers_and_one_cell_per_block(tmp_path):
    data, html = _plan_json_and_page(tmp_path)
    page = Page(html)
    checked = check_numbers(page, {"": data})
    cells = page.with_class("blk")
    expected = sum(len(ids) for s in data["steps"] for r in s["requests"] for ids in r["blocks"].values())
    assert len(cells) == expected > 0
    # every block id and every request's computed/scheduled/draft count is shown and checked
    numbers_per_request = 3 * sum(len(s["requests"]) for s in data["steps"])
    assert checked >= expected + numbers_per_request + 4
    # the cells are in plan order: step, request, group, column
    shown = [(int(c.attrs["data-step"]), c.attrs["data-group"], int(c.attrs["data-block"])) for c in cells]
    planned = [
        (i, g, b)
        for i, s in enumerate(data["steps"])
        for r in s["requests"]
        for g, ids in r["blocks"].items()
        for b in ids
    ]
    assert shown == planned
    assert network_references(html) == []


def test_each_step_names_its_shape_and_the_graph_the_dispatcher_would_pick():
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256),
        speculative=SpeculativeConfig.parse("draft_model:2"),
    )
    groups = [KVCacheGroup("full", FullAttentionSpec(16, num_kv_heads=1, head_size=8), ("l0",))]
    view = plan_view(plan_warmup(config, groups, 64))
    capture = plan_capture(CaptureFacts.of_config(config, groups, TorchPagedAttention(), None))
    graphs = planned_graphs(capture)
    page = Page(plan_page(view, capture))
    headers = [e for e in page.elements if e.tag == "div" and "shape" in e.classes]
    assert len(headers) == len(view["steps"])
    uniform = 0
    for step, header in zip(view["steps"], headers, strict=True):
        shape = step_shape(step)
        assert f"shape {shape.num_tokens} tokens / {shape.num_reqs} requests" in header.text
        graph = graph_for(shape, graphs)
        assert graph is not None, step["name"]
        if step["name"] == "decode_all_spec":
            # all-decode, 1+k tokens each: the uniform-decode graph of exactly this batch
            assert (graph["phase"], graph["uniform_query_len"], graph["num_reqs"]) == (
                "decode",
                3,
                shape.num_reqs,
            )
            uniform += 1
        label = f"{graph['phase']} {graph['mode']} t={graph['num_tokens']}"
        assert label in header.text
    assert uniform == 1


def test_null_blocks_of_a_sliding_window_are_marked_and_shared_blocks_framed():
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
        speculative=SpeculativeConfig.parse("draft_model:2"),
    )
    groups = [
        KVCacheGroup("full", FullAttentionSpec(4, num_kv_heads=1, head_size=8), ("l0",)),
        KVCacheGroup(
            "sliding_window", SlidingWindowSpec(4, num_kv_heads=1, head_size=8, sliding_window=4), ("l1",)
        ),
    ]
    view = plan_view(plan_warmup(config, groups, 256))
    # Two requests holding one block is what a shared prefix looks like (warmup plans never share).
    first = next(s for s in view["steps"] if len(s["requests"]) > 1)["requests"]
    first[1]["blocks"]["full"][0] = first[0]["blocks"]["full"][0]
    page = Page(plan_page(view, None))
    nulls = [c for c in page.with_class("null") if c.attrs.get("data-block") == "0"]
    planned_nulls = sum(
        ids.count(0) for s in view["steps"] for r in s["requests"] for ids in r["blocks"].values()
    )
    assert planned_nulls > 0 and len(nulls) == planned_nulls
    assert all(c.attrs["data-group"] == "sliding_window" and "null" in c.text for c in nulls)
    shared = page.with_class("shared")
    assert len(shared) == 2 and {c.attrs["data-block"] for c in shared} == {
        str(first[0]["blocks"]["full"][0])
    }
    assert f"shared with {first[1]['req_id']}" in shared[0].attrs["data-info"]


def test_plan_html_to_a_missing_folder_is_one_clear_error(tmp_path):
    res = runner.invoke(app, [*PLAN_ARGS, "--html", str(tmp_path / "nope" / "plan.html")])
    assert res.exit_code == 2
    assert "--html" in res.output and "does not exist" in res.output and "Traceback" not in res.output


@pytest.mark.real_model
def test_default_models_plan_page_is_small_enough_to_attach(tmp_path):
    out = tmp_path / "plan.html"
    args = ["plan", "--spec", "draft_model:2", "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
    args += ["--max-model-len", "1024"]
    res = runner.invoke(app, [*args, "--html", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(runner.invoke(app, [*args, "--json"]).output)
    html = out.read_text()
    assert len(html.encode()) < 2 * 2**20
    check_numbers(Page(html), {"": data})
    assert network_references(html) == []
