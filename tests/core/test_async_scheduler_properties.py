"""Hypothesis properties of async scheduling (one step in flight) against a model whose every
token is fixed by its request and position: each request's outputs are exactly that model's
sequence (so the same as a synchronous schedule's), every step writes only inside the blocks its
requests hold although it was scheduled on optimistic counts, a request never runs more than one
sampling step past its end, and every block comes back."""

from __future__ import annotations

import random
from collections import Counter

from core_fakes import VOCAB, full_groups, make_request, make_scheduler
from hypothesis import event, given, settings
from hypothesis import strategies as st

from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.reservation import reserved_blocks
from warmcap.core.scheduler import Scheduler
from warmcap.errors import CapacityError

EOS = 0


def true_token(req_id: str, position: int) -> int:
    """The model: the token after ``position`` tokens of request ``req_id`` (EOS now and then)."""
    return random.Random(f"{req_id}:{position}").randrange(VOCAB)


class AsyncFakeRunner:
    """Plays the runner under async scheduling: it keeps each request's true tokens, takes a
    step's computed counts and drafts from them (the schedule's are optimistic placeholders),
    verifies drafts against the model and proposes drafts that are right with some chance."""

    def __init__(self, sched: Scheduler, rng: random.Random) -> None:
        self.sched = sched
        self.rng = rng
        self.k = sched.num_spec_tokens
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.proposals: dict[str, list[int]] = {}
        #: sampling steps per request (a request's outputs + at most one discarded)
        self.samples: Counter[str] = Counter()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
            self.computed[new.req_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            known = len(self.tokens[cached.req_id]) - 1
            self.computed[cached.req_id] = min(cached.num_computed_tokens, known)
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        verified: dict[str, int] = {}
        proposals: dict[str, list[int]] = {}
        for req_id in req_ids:
            tokens, start = self.tokens[req_id], self.computed[req_id]
            placeholders = out.scheduled_spec_decode_tokens.get(req_id, [])
            drafts = self.proposals.get(req_id, [])[: len(placeholders)]
            n = out.num_scheduled_tokens[req_id] - len(placeholders) + len(drafts)
            assert n >= 1
            # The step writes positions start .. start + n - 1: inside the blocks it holds.
            spec = self.sched.kv.managers[0].spec
            need = reserved_blocks(
                spec, start + n, num_lookahead_tokens=0, max_model_len=self.sched.max_model_len
            )
            assert self.sched.kv.num_held_blocks(req_id)["full"] >= need
            if start + n - len(drafts) < len(tokens):
                self.computed[req_id] = start + n  # a prompt chunk
                sampled.append([])
                continue
            assert start + n - len(drafts) == len(tokens)
            accepted = []
            for d in drafts:
                if d != true_token(req_id, len(tokens) + len(accepted)):
                    break
                accepted.append(d)
            new = [*accepted, true_token(req_id, len(tokens) + len(accepted))]
            tokens += new
            self.computed[req_id] = len(tokens) - 1
            self.samples[req_id] += 1
            sampled.append(new)
            if drafts:
                verified[req_id] = len(drafts)
            if self.k:
                proposals[req_id] = [
                    true_token(req_id, len(tokens) + i)
                    if self.rng.random() < 0.6
                    else self.rng.randrange(VOCAB)
                    for i in range(self.rng.randint(0, self.k))
                ]
        self.proposals = proposals
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, draft_token_ids=proposals, num_draft_tokens=verified
        )


def expected_outputs(req_id: str, prompt_len: int, max_tokens: int, max_model_len: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens and prompt_len + len(out) < max_model_len:
        out.append(true_token(req_id, prompt_len + len(out)))
        if out[-1] == EOS:
            break
    return out


@settings(max_examples=300, deadline=None)
@given(
    spec=st.sampled_from([None, "ngram:2", "draft_model:3", "eagle:1"]),
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 4, 16]),
    max_model_len=st.integers(8, 64),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(4, 48),
    pool=st.integers(6, 40),
    num_requests=st.integers(1, 8),
)
def test_async_schedule_gives_the_models_tokens_inside_its_blocks(
    spec, seed, block_size, max_model_len, max_num_seqs, budget, pool, num_requests
):
    rng = random.Random(seed)
    sched = make_scheduler(
        spec=spec,
        num_blocks=pool,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        groups=full_groups(block_size),
        eos_token_id=EOS,
        async_scheduling=True,
    )
    runner = AsyncFakeRunner(sched, rng)
    want: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for i in range(num_requests):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_model_len - 1))]
        req = make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 20))
        try:
            sched.add_request(req)
        except CapacityError:
            continue
        want[req.request_id] = expected_outputs(
            req.request_id, len(prompt), req.sampling_params.max_tokens, max_model_len
        )
    inflight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    steps = 0
    while sched.has_unfinished_requests() or inflight is not None:
        steps += 1
        assert steps < 3000, "no progress"
        if sched.running and rng.random() < 0.03:
            victim = rng.choice(sched.running).request_id
            sched.abort_request(victim)
            aborted.add(victim)
        out = sched.schedule()
        result = runner.execute(out)
        done = [inflight] if inflight is not None else []
        inflight = None if out.is_empty else (out, result)
        if out.is_empty:
            done.append((out, result))
        for step_out, step_result in done:
            for res in sched.update_from_output(step_out, step_result):
                got.setdefault(res.req_id, []).extend(res.new_token_ids)
        if out.preempted_req_ids:
            event("preemption while a step is in flight")
        if out.scheduled_spec_decode_tokens:
            event("placeholder drafts")
    for req_id, tokens in want.items():
        if req_id in aborted:
            assert got.get(req_id, []) == tokens[: len(got.get(req_id, []))]
            continue
        assert got[req_id] == tokens, req_id
    # A request's sampling steps: its outputs, plus at most one whose token was discarded (a stop
    # found a step late), plus one a preemption may have discarded each time.
    for req_id, tokens in got.items():
        req_extra = runner.samples[req_id] - len(tokens)
        assert req_extra <= 1 + 2 * sched.num_preemptions or req_id in aborted, (req_id, req_extra)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks - 1
