"""The runner end to end on a tiny attention model: paged + chunked + batched greedy equals full
recompute, drafts are verified exactly, every KV write lands in a held block."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from runner_fakes import LoopPagedAttention, MiniScheduler, TinyAttnModel

from warmcap.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from warmcap.contracts import PAD_SLOT_ID
from warmcap.core.kv_spec import group_layers
from warmcap.runner_v2.model_runner import ModelRunner
from warmcap.sampling_params import SamplingParams

BS = 4


def _setup(budget: int = 7, speculative: SpeculativeConfig | None = None):
    model = TinyAttnModel()
    config = EngineConfig(
        model=ModelConfig(model="tiny"),
        cache=CacheConfig(block_size=BS, num_blocks=200),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64),
        speculative=speculative,
    )
    groups = group_layers(model.kv_layer_specs(BS))
    runner = ModelRunner(config, model, groups, 200, device="cpu", attn_backend=LoopPagedAttention())
    sched = MiniScheduler(
        groups[0].spec, groups[0].name, max_model_len=64, budget=budget, lookahead=config.num_lookahead_tokens
    )
    return model, runner, sched


PROMPTS = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5], "b": [2, 7], "c": [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7, 4, 9]}


def test_paged_chunked_batched_greedy_equals_full_recompute() -> None:
    model, runner, sched = _setup()
    recording = ExitStack()
    recording.enter_context(runner.recording_kv_writes())
    firsts: dict[str, torch.Tensor] = {}

    def hook(req_ids, num_logits, logits):
        for i, req_id in enumerate(r for r, n in zip(req_ids, num_logits, strict=True) if n):
            firsts.setdefault(req_id, logits[i])

    runner.logits_hook = hook
    sched.add("a", PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=6))
    sched.add("b", PROMPTS["b"], SamplingParams(temperature=0.0, max_tokens=9))
    steps = 0
    while sched.reqs:
        if steps == 3:  # joins mid-run
            sched.add("c", PROMPTS["c"], SamplingParams(temperature=0.0, max_tokens=5))
        out = sched.schedule()
        sched.update(out, runner.execute_model(out))
        steps += 1
    runner.execute_model(sched.schedule())  # delivers the last finish
    recording.close()
    assert runner.batch.num_reqs == 0
    for req_id, tokens in sched.done.items():
        expected, first_logits = model.dense_greedy(PROMPTS[req_id], len(tokens))
        assert tokens == expected, req_id
        torch.testing.assert_close(firsts[req_id], first_logits, atol=1e-5, rtol=1e-5)

    log = runner.kv_write_log
    assert log.records and all(r.phase == "target" for r in log.records)
    for rec in log.records:
        qsl = rec.query_start_loc
        for i, req_id in enumerate(rec.req_ids):
            held = set(rec.block_ids[req_id])
            for slot, pos in zip(
                rec.slot_mapping[qsl[i] : qsl[i + 1]].tolist(),
                rec.positions[qsl[i] : qsl[i + 1]].tolist(),
                strict=True,
            ):
                assert slot // BS in held and slot % BS == pos % BS
        assert rec.slot_mapping[qsl[-1] :].eq(PAD_SLOT_ID).all()


def test_drafts_equal_to_greedy_are_all_accepted_and_wrong_ones_rejected() -> None:
    model, runner, sched = _setup(budget=32, speculative=SpeculativeConfig("eagle", num_speculative_tokens=3))
    prompt = PROMPTS["a"]
    expected, _ = model.dense_greedy(prompt, 12)
    sched.add("a", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    out = sched.schedule()
    result = runner.execute_model(out)
    sched.update(out, result)
    assert result.sampled_token_ids == [expected[:1]]
    # Three correct drafts: all accepted plus the bonus token.
    out = sched.schedule({"a": expected[1:4]})
    result = runner.execute_model(out)
    sched.update(out, result)
    assert result.sampled_token_ids == [expected[1:5]]
    assert result.num_draft_tokens == {"a": 3}
    # First draft right, second wrong: one accepted, then the target's own token.
    wrong = (expected[6] + 1) % 64
    out = sched.schedule({"a": [expected[5], wrong, expected[7]]})
    result = runner.execute_model(out)
    sched.update(out, result)
    assert result.sampled_token_ids == [expected[5:7]]
    while sched.reqs:
        out = sched.schedule()
        sched.update(out, runner.execute_model(out))
    assert sched.done["a"] == expected


def test_seeded_sampling_is_reproducible_across_batches() -> None:
    def run(with_neighbour: bool) -> list[int]:
        _, runner, sched = _setup(budget=64)
        sched.add("s", PROMPTS["a"], SamplingParams(temperature=1.0, seed=42, max_tokens=8))
        if with_neighbour:
            sched.add("n", PROMPTS["c"], SamplingParams(temperature=1.0, max_tokens=8))
        while "s" in sched.reqs:
            out = sched.schedule()
            sched.update(out, runner.execute_model(out))
        return sched.done["s"]

    assert run(False) == run(True)


def test_seeded_verification_of_drafts_is_reproducible() -> None:
    def run() -> list[list[int]]:
        _, runner, sched = _setup(budget=32, speculative=SpeculativeConfig("eagle", num_speculative_tokens=2))
        sched.add("a", PROMPTS["a"], SamplingParams(temperature=0.8, seed=7, max_tokens=10))
        got = []
        drafts: dict[str, list[int]] = {}
        while sched.reqs:
            out = sched.schedule(drafts)
            result = runner.execute_model(out)
            sched.update(out, result)
            got.append(result.sampled_token_ids[0] if result.sampled_token_ids else [])
            drafts = {"a": [1, 2]}
        return got

    first = run()
    assert first == run()
    assert all(1 <= len(tokens) <= 3 for tokens in first)


def test_sampling_settings_follow_requests_that_join_and_leave_mid_stream() -> None:
    # The runner reuses a step's sampling metadata while the batch's composition holds: a seeded
    # random request joining a greedy one must be sampled as when alone, and the greedy request must
    # stay greedy before, while and after the random one runs.
    greedy = SamplingParams(temperature=0.0, max_tokens=14)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=5)

    def alone(req_id: str, params: SamplingParams) -> list[int]:
        _, runner, sched = _setup(budget=64)
        sched.add(req_id, PROMPTS[req_id], params)
        while req_id in sched.reqs:
            out = sched.schedule()
            sched.update(out, runner.execute_model(out))
        return sched.done[req_id]

    _, runner, sched = _setup(budget=64)
    # First a greedy request alone, then a seeded one in the row it left (the same step rows).
    for req_id, params in (("b", greedy), ("c", seeded)):
        sched.add(req_id, PROMPTS[req_id], params)
        while sched.reqs:
            out = sched.schedule()
            sched.update(out, runner.execute_model(out))
    assert sched.done["c"] == alone("c", seeded)
    assert sched.done["b"] == alone("b", greedy)
    sched.add("a", PROMPTS["a"], greedy)
    for _ in range(4):
        out = sched.schedule()
        sched.update(out, runner.execute_model(out))
    sched.add("c", PROMPTS["c"], seeded)
    while sched.reqs:
        out = sched.schedule()
        sched.update(out, runner.execute_model(out))
    assert sched.done["c"] == alone("c", seeded)
    assert sched.done["a"] == alone("a", greedy)


def test_a_greedy_head_that_declines_a_row_on_the_device_sends_the_step_to_the_full_logits() -> None:
    # A head with ``declines_on_device`` (the fused CUDA head) marks a non-finite row with -1 instead
    # of reading the device; the runner sees it in the step's one fetch and samples from the full
    # logits, so the tokens are the full path's.
    class DecliningHead:
        declines_on_device = True

        def __init__(self, model) -> None:
            self.model, self.calls = model, 0

        def argmax(self, x: torch.Tensor, *, decline: bool = False) -> torch.Tensor:
            self.calls += 1
            ids = self.model.compute_logits(x).argmax(dim=-1)
            return torch.where(torch.arange(len(ids)) == 0, -1, ids) if self.calls % 2 else ids

    def run(head) -> tuple[dict[str, list[int]], int]:
        model, runner, sched = _setup(budget=64)
        runner.greedy_head = head(model) if head else None
        full = 0
        for req_id in ("a", "b"):
            sched.add(req_id, PROMPTS[req_id], SamplingParams(temperature=0.0, max_tokens=6))
        while sched.reqs:
            out = sched.schedule()
            sched.update(out, runner.execute_model(out))
            full += runner.last_logits is not None
        return sched.done, full

    plain, _ = run(None)
    declined, full_steps = run(DecliningHead)
    assert declined == plain
    assert full_steps == 3, "every other step's head declined a row: those steps took the full logits"
