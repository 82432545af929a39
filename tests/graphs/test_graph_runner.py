"""Serving through graphs: dispatch, padding and replay give the same tokens as eager."""

from __future__ import annotations

import pytest
import torch
from graph_fixtures import make_rig, tiny_llama

from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request
from warmcap.core.scheduler import Scheduler
from warmcap.graphs.capture.descriptors import BatchShape
from warmcap.graphs.capture.graph_runner import GraphRunner
from warmcap.graphs.capture.subjects import step_shape
from warmcap.graphs.startup import capture_graphs
from warmcap.runner_v2.model_runner import ModelRunner
from warmcap.sampling_params import SamplingParams

PROMPTS = [[5, 9, 2, 6, 5, 3, 5], [8, 9, 7], [9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8], [1, 1]]


@torch.inference_mode()
def _graph_step(runner: ModelRunner, graphs: GraphRunner, sched_out: SchedulerOutput) -> ModelRunnerOutput:
    """Greedy step whose forward goes through ``graphs`` (what the runner hook does), eager fallback."""
    runner.batch.update(sched_out)
    if sched_out.is_empty:
        return ModelRunnerOutput()
    step = runner.batch.prepare_inputs(sched_out)
    replay = graphs.replay_step(step)
    hidden = replay.output if replay is not None else None
    if hidden is None:
        runner.buffers.copy_from(step)
        hidden = runner.forward_batch(
            step.num_tokens, runner.buffers.attn_metadata(num_columns=step.max_num_blocks)
        )
    logits = runner.model.compute_logits(hidden[torch.from_numpy(step.logits_indices)])
    tokens = logits.argmax(-1).tolist()
    sampled, offset = [], 0
    for req_id, n in zip(step.req_ids, step.num_logits.tolist(), strict=True):
        sampled.append(tokens[offset : offset + n])
        offset += n
        runner.batch.append_tokens(req_id, sampled[-1])
    return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=sampled)


def _generate(rig, step_fn) -> dict[str, list[int]]:
    sched = Scheduler(rig.config, rig.manager)
    requests = []
    for i, prompt in enumerate(PROMPTS):
        req = Request(f"r{i}", list(prompt), SamplingParams(temperature=0.0, max_tokens=6 + i))
        sched.add_request(req)
        requests.append(req)
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, step_fn(out))
    return {r.request_id: list(r.output_token_ids) for r in requests}


@pytest.mark.slow
def test_generation_through_graphs_equals_eager_generation() -> None:
    model = tiny_llama()
    eager = make_rig(model=model, budget=12)
    expected = _generate(eager, eager.runner.execute_model)

    rig = make_rig(model=model, budget=12)
    startup = capture_graphs(rig.runner, rig.manager, backend="static")
    graphs = startup.graph_runner
    got = _generate(rig, lambda out: _graph_step(rig.runner, graphs, out))
    assert got == expected
    assert sum(graphs.replays.values()) > 0
    # Decode steps of 1..4 requests went to uniform-decode graphs, prefill chunks to mixed ones.
    used = {d for d, n in graphs.replays.items() if n}
    assert any(d.uniform_query_len for d in used) and any(d.uniform_query_len is None for d in used)


def test_step_shape_marks_prompt_chunks_as_not_decode() -> None:
    rig = make_rig(k=1)
    sched = Scheduler(rig.config, rig.manager)
    # A prompt of 1+(1+k) = 3 tokens, chunked to 2 = 1+k tokens: uniform length, but a prefill.
    sched.add_request(Request("p", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=2)))
    out = sched.schedule()
    out.num_scheduled_tokens["p"] = 2
    rig.runner.batch.update(out)
    shape = step_shape(rig.runner.batch.prepare_inputs(out))
    assert shape == BatchShape(2, 1, 2, False, 2)
