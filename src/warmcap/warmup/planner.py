"""Warmup planning through the scheduler's own allocator (invariants I1 and I2).

``plan_warmup`` never counts blocks itself: it drives a scratch :class:`KVCacheManager` of the same
size and groups as production, so every planned request holds exactly what the scheduler would
give it. The steps are real :class:`SchedulerOutput` records that the runner executes unchanged,
built by the scheduler's :class:`StepBuilder` in the scheduler's row order (running requests first,
in admission order, then the prompts that join them), and each step's results are applied by
:meth:`Scheduler.update_from_output` itself (drafts rolled back, tokens appended, a request that
reaches ``max_model_len`` finished and its blocks freed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import lcm

from warmcap.config import EngineConfig
from warmcap.core.kv_cache_manager import KVCacheManager
from warmcap.core.kv_spec import CrossAttentionSpec, KVCacheGroup, MambaSpec
from warmcap.core.outputs import ModelRunnerOutput, SchedulerOutput
from warmcap.core.request import Request, RequestStatus
from warmcap.core.reservation import block_of, reserved_blocks
from warmcap.core.scheduler import Scheduler
from warmcap.core.step_builder import StepBuilder
from warmcap.core.step_rules import step_lookahead
from warmcap.errors import CapacityError
from warmcap.sampling_params import SamplingParams
from warmcap.warmup.plan import PlannedRequest, SkippedStep, WarmupPlan, WarmupStep

STEP_KINDS = ("prefill", "decode", "mixed", "sparse_mla")
_WARMUP_PARAMS = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


class _DoesNotFit(Exception):
    """A candidate layout needs more blocks, tokens or sequences than the config allows."""


@dataclass(slots=True)
class _Entry:
    request: Request
    num_new_tokens: int
    num_spec: int
    is_new: bool


class _Simulator:
    """Runs candidate steps against a scratch manager, recording what production would hold."""

    def __init__(
        self,
        config: EngineConfig,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        max_encoder_len: int,
        lookahead: int,
    ) -> None:
        self.config = config
        self.groups = list(groups)
        self.max_model_len = config.max_model_len
        self.max_encoder_len = max_encoder_len
        self.lookahead = lookahead
        # Prefix caching is off: warmup prompts are dummies, and a hit would make concurrent
        # requests share blocks, which the plan must never do.
        self.manager = KVCacheManager(
            groups,
            num_blocks,
            max_model_len=self.max_model_len,
            enable_caching=False,
            max_encoder_len=max_encoder_len,
        )
        #: the scheduler's own admission and allocation (core/step_builder.py); ``lookahead`` is
        #: what each request reserves, the config's lookahead what the runner is told it may write
        self.builder = StepBuilder(config, self.manager, reserved_lookahead=lookahead)
        #: the scheduler over the same manager, for its result step alone (``advance``): it never
        #: schedules here. Warmup runs its steps one at a time, so its results are synchronous.
        synchronous = (
            replace(config, scheduler=replace(config.scheduler, async_scheduling=False))
            if config.scheduler.async_scheduling
            else config
        )
        self.scheduler = Scheduler(synchronous, self.manager)
        self.steps: list[WarmupStep] = []
        #: the requests that hold seats and blocks, by id, in admission order: the scheduler's own
        #: table, so a request it finishes (at max_model_len) leaves it as in serving
        self.running: dict[str, Request] = self.scheduler.requests
        self._num_created = 0
        #: requests the scheduler finished since the last step: the next step tells the runner, as
        #: the scheduler's next step would (``SchedulerOutput.finished_req_ids``)
        self._finished: set[str] = set()

    def new_request(self, prompt_len: int) -> Request:
        """The next warmup request (``warmup-<i>``: ids are never reused, even after one finished)."""
        req_id = f"warmup-{self._num_created}"
        self._num_created += 1
        # Distinct small token ids per request keep ngram lookups and embeddings non-degenerate.
        base = len(self.running) + 1
        prompt = [(base * 7 + i) % 97 + 1 for i in range(prompt_len)]
        return Request(req_id, prompt, _WARMUP_PARAMS, num_encoder_tokens=self.max_encoder_len)

    def _admit(self, req: Request) -> None:
        """Hand a request the builder started to the scheduler as running. NOTE: not through
        ``Scheduler.add_request``, which refuses up front a request whose ``max_tokens`` could one
        day outgrow the pool; a warmup request stops after its planned steps."""
        req.status = RequestStatus.RUNNING
        self.scheduler.requests[req.request_id] = req
        self.scheduler.running.append(req)

    def step(self, name: str, kind: str, reason: str, entries: list[_Entry]) -> WarmupStep:
        """Build one step through the scheduler's own builder; raises :class:`_DoesNotFit` unless
        every entry gets exactly its planned tokens (admission, budget, length cap and pool all
        decided there, never here)."""
        builder = self.builder
        budget = builder.max_num_batched_tokens
        # The scheduler's prompt allowance over the requests already running in this step.
        prompt_left = builder.prompt_allowance(e.request for e in entries if not e.is_new)
        out = SchedulerOutput(finished_req_ids=self._finished)
        self._finished = set()
        planned: list[PlannedRequest] = []
        for e in entries:
            req = e.request
            c = req.num_computed_tokens
            before = self.manager.num_held_blocks(req.request_id)
            prompt = e.is_new or not req.in_decode
            limit = min(budget, prompt_left) if prompt else budget
            if e.is_new:
                if not builder.has_seat(len(self.running), limit):
                    raise _DoesNotFit(
                        f"{name}: {req.request_id} finds no seat ({len(self.running)} running of "
                        f"max_num_seqs={builder.max_num_seqs}, {budget} tokens left of "
                        f"max_num_batched_tokens={builder.max_num_batched_tokens})"
                    )
                got = builder.add_waiting(out, req, limit)
            else:
                if req.request_id not in self.running:
                    raise _DoesNotFit(
                        f"{name}: {req.request_id} finished when it reached max_model_len="
                        f"{self.max_model_len}; another step would pass max_model_len"
                    )
                req.spec_token_ids = [1 + (i % 89) for i in range(e.num_spec)]
                got = builder.add_running(out, req, limit)
            if got is None:
                raise _DoesNotFit(f"{name}: the pool has no room for {req.request_id}")
            if not got and e.is_new:
                raise _DoesNotFit(
                    f"{name}: {req.request_id} cannot start: the pool has no room, or its prompt does "
                    f"not fit the {limit} tokens left and chunked prefill is off"
                )
            if got > e.num_new_tokens:
                raise RuntimeError(
                    f"{name}: {req.request_id} has {got} tokens to schedule but the plan gave it "
                    f"{e.num_new_tokens}: the planner lost track of the request's tokens"
                )
            if got != e.num_new_tokens:
                raise _DoesNotFit(
                    f"{name}: {e.num_new_tokens} tokens of {req.request_id} exceed the {budget} left of "
                    f"max_num_batched_tokens={builder.max_num_batched_tokens}"
                    if got == budget
                    else f"{name}: {e.num_new_tokens} prompt tokens of {req.request_id} exceed the "
                    f"{limit} left of max_prefill_tokens_with_decodes="
                    f"{builder.max_prefill_tokens_with_decodes} (requests decode in this step)"
                    if got == limit
                    else f"{name}: {req.request_id} would pass max_model_len={self.max_model_len} "
                    f"({c} computed + {e.num_new_tokens} scheduled; a step ends by max_model_len - 1)"
                )
            budget -= got
            if prompt:
                prompt_left -= got
            if e.is_new:
                self._admit(req)
            held = self.manager.get_block_ids(req.request_id)
            planned.append(
                PlannedRequest(
                    req.request_id,
                    c,
                    got,
                    e.num_spec,
                    self.lookahead,
                    held,
                    self._crossings(before, held, c, c + got),
                )
            )
        step = WarmupStep(name, kind, reason, out, planned)
        self.steps.append(step)
        return step

    def _crossings(
        self, before: dict[str, int], held: dict[str, list[int]], first: int, num_tokens: int
    ) -> dict[str, str]:
        """Per group: "tokens" when this step's tokens are the first to land in a block, else
        "lookahead" when only the drafter's reserved lookahead made the request take a new block."""
        crossed: dict[str, str] = {}
        for g in self.groups:
            if isinstance(g.spec, (CrossAttentionSpec, MambaSpec)) or first == 0:
                continue
            if block_of(g.spec, num_tokens - 1) > block_of(g.spec, first - 1):
                crossed[g.name] = "tokens"
            elif len(held[g.name]) > before[g.name]:
                crossed[g.name] = "lookahead"
        return crossed

    def advance(self, step: WarmupStep, accepted: dict[str, int] | None = None) -> None:
        """Apply a step's results through :meth:`Scheduler.update_from_output`: each request that
        reached the end of its known tokens samples its accepted drafts (``accepted`` per request;
        all when absent) plus one token, as a runner would report them."""
        out = step.scheduler_output
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            req = self.running[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, ())
            num_acc = len(drafts) if accepted is None else accepted.get(req_id, len(drafts))
            # A prompt chunk short of the prompt's end samples nothing (the builder has already
            # moved the computed count past this step's tokens).
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([*drafts[:num_acc], 1] if done else [])
        results = self.scheduler.update_from_output(
            out, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        )
        self._finished.update(r.req_id for r in results if r.finished)

    def run(self, name: str, kind: str, reason: str, entries: list[_Entry]) -> WarmupStep:
        """Build a step and apply its results with every draft accepted."""
        step = self.step(name, kind, reason, entries)
        self.advance(step)
        return step


def _crossable_block_size(groups: Sequence[KVCacheGroup], max_model_len: int) -> int | None:
    """Least common block boundary of every group that can ever cross one within max_model_len."""
    sizes = [
        g.spec.block_size
        for g in groups
        if not isinstance(g.spec, CrossAttentionSpec)
        and reserved_blocks(g.spec, max_model_len, num_lookahead_tokens=0, max_model_len=max_model_len)
        > reserved_blocks(g.spec, 1, num_lookahead_tokens=0, max_model_len=max_model_len)
    ]
    return lcm(*sizes) if sizes else None


def plan_warmup(
    config: EngineConfig,
    kv_groups: Sequence[KVCacheGroup],
    num_blocks: int,
    *,
    max_encoder_len: int = 0,
    lookahead_override: int | None = None,
) -> WarmupPlan:
    """Plan warmup steps for ``config`` over ``kv_groups`` in a pool of ``num_blocks`` blocks.

    ``lookahead_override`` is a test seam: it replaces the config's lookahead to build the broken
    plans that the audit must catch. Raises :class:`CapacityError` when not even one request fits.
    """
    if not kv_groups:
        raise CapacityError("no KV cache groups: the model declares no attention or state layers")
    # Warmup requests are computed locally, a P/D consumer's included: none loads KV from outside,
    # so each reserves the step rule's full lookahead (its drafter runs and writes past its tokens).
    lookahead = step_lookahead(config) if lookahead_override is None else lookahead_override
    attempt = _Attempt(config, kv_groups, num_blocks, max_encoder_len, lookahead)
    sched = config.scheduler
    budget_batch = max(1, min(sched.max_num_seqs, sched.max_num_batched_tokens // attempt.prompt_len))
    last_error = ""
    for extras in ((True, True), (True, False), (False, False)):
        n = budget_batch
        while n >= 1:
            try:
                return attempt.build(n, boundary=extras[0], mixed=extras[1])
            except _DoesNotFit as exc:
                last_error = str(exc)
                n //= 2
    smallest = _smallest_pool(config, kv_groups, max_encoder_len, lookahead)
    if smallest is None:
        # No pool size helps: the context limit is what refuses the request, so name it.
        mml = config.max_model_len
        least = _least_max_model_len(config, kv_groups, max_encoder_len, lookahead)
        k = config.num_speculative_tokens
        if least is not None:
            raise CapacityError(
                f"max_model_len {mml} is smaller than one request's warmup steps need ({least} tokens: a "
                f"prompt of {2 + k}, its decode steps{f' with {k} speculative tokens' if k else ''}): "
                f"raise --max-model-len to at least {least}"
            )
        raise CapacityError(
            f"warmup cannot plan even one request: {last_error}. The pool is not the limit "
            f"({num_blocks - 1} usable blocks): raise --max-model-len (or lower the speculative k)."
        )
    raise CapacityError(
        f"warmup cannot fit even one request: {last_error}. Its steps need a pool of {smallest} blocks "
        f"across {len(kv_groups)} KV group(s) (null block included); the pool has {num_blocks}. "
        f"Raise --num-blocks to at least {smallest} (or lower --max-model-len / the speculative k)."
    )


def _smallest_pool(config, kv_groups, max_encoder_len, lookahead) -> int | None:
    """The fewest blocks (null block included) with which one warmup request's steps all fit, or
    None when no pool size does (the limit is then max_model_len, not memory)."""

    def fits(num_blocks: int) -> bool:
        try:
            _Attempt(config, kv_groups, num_blocks, max_encoder_len, lookahead).build(
                1, boundary=False, mixed=False
            )
        except _DoesNotFit:
            return False
        return True

    # One request never holds more than every group's count at max_model_len.
    most = 1 + _Attempt(config, kv_groups, 2, max_encoder_len, lookahead).blocks_at_most()
    if not fits(most):
        return None
    lo, hi = 2, most
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _least_max_model_len(config, kv_groups, max_encoder_len, lookahead, *, search: int = 1024) -> int | None:
    """The smallest ``max_model_len`` above the config's with which one warmup request's steps fit
    some pool (None: none within ``search`` tokens more)."""
    from dataclasses import replace

    for mml in range(config.max_model_len + 1, config.max_model_len + search + 1):
        longer = replace(config, scheduler=replace(config.scheduler, max_model_len=mml))
        if _smallest_pool(longer, kv_groups, max_encoder_len, lookahead) is not None:
            return mml
    return None


class _Attempt:
    """One layout candidate: n batch requests plus the optional boundary and mixed requests."""

    def __init__(self, config, groups, num_blocks, max_encoder_len, lookahead) -> None:
        self.config = config
        self.groups = list(groups)
        self.num_blocks = num_blocks
        self.max_encoder_len = max_encoder_len
        self.lookahead = lookahead
        self.k = config.num_speculative_tokens
        self.q = config.uniform_decode_query_len
        # NOTE: one token longer than a uniform decode, so no prefill can pass for a decode batch.
        self.prompt_len = 1 + self.q

    def blocks_at_most(self) -> int:
        """Blocks one request holds at ``max_model_len`` tokens, summed over the groups."""
        sim = _Simulator(self.config, self.groups, self.num_blocks, self.max_encoder_len, self.lookahead)
        return sim.manager.blocks_needed(
            self.config.max_model_len,
            num_lookahead_tokens=self.lookahead,
            num_encoder_tokens=self.max_encoder_len,
        )

    def build(self, n: int, *, boundary: bool, mixed: bool) -> WarmupPlan:
        cfg, k, q = self.config, self.k, self.q
        sim = _Simulator(cfg, self.groups, self.num_blocks, self.max_encoder_len, self.lookahead)
        plan = WarmupPlan(
            model=cfg.model.model,
            method=cfg.speculative.method if cfg.speculative else None,
            num_speculative_tokens=k,
            block_size=cfg.cache.block_size,
            max_model_len=cfg.max_model_len,
            num_lookahead_tokens=self.lookahead,
            num_blocks=self.num_blocks,
            kv_groups=self.groups,
        )
        batch = [sim.new_request(self.prompt_len) for _ in range(n)]
        sim.run(
            "prefill",
            "prefill",
            f"{n} prompt(s) of 1+(1+k)={self.prompt_len} tokens: a prefill that no "
            "uniform-decode shape can be mistaken for",
            [_Entry(r, self.prompt_len, 0, True) for r in batch],
        )

        def decode(name: str, reason: str, reqs: list[Request], with_spec: list[bool]) -> None:
            es = [
                _Entry(r, 1 + (k if s else 0), k if s else 0, False)
                for r, s in zip(reqs, with_spec, strict=True)
            ]
            sim.run(name, "decode", reason, es)

        decode("decode_all_spec", f"uniform decode: every request verifies 1+k={q} tokens", batch, [True] * n)
        if k:
            mix = [i % 2 == 0 for i in range(n)] if n > 1 else [False]
            decode("decode_spec_mix", "requests with and without drafts in one batch", batch, mix)
            decode("decode_single_spec", "one request with drafts", batch[:1], [True])
            decode("decode_single_nospec", "one request without drafts", batch[:1], [False])
        else:
            decode("decode_single", "one request decoding alone", batch[:1], [False])
        if boundary:
            self._cross_boundaries(sim, plan)
        else:
            plan.skipped.append(SkippedStep("block_boundary", "no room for a boundary-crossing request"))
        if mixed:
            self._mixed(sim, batch)
        else:
            plan.skipped.append(
                SkippedStep("mixed_prefill_decode", "no room for a request joining mid-batch")
            )
        plan.steps = sim.steps
        return plan

    def _cross_boundaries(self, sim: _Simulator, plan: WarmupPlan) -> None:
        """A request whose prompt ends just before a block boundary of every group, decoded until
        the lookahead alone crosses it and then the scheduled tokens do."""
        k, q, L, M = self.k, self.q, self.lookahead, self.config.max_model_len
        unit = _crossable_block_size(self.groups, M)
        if unit is None:
            plan.skipped.append(
                SkippedStep("block_boundary", "no group can cross a block within max_model_len")
            )
            return
        boundary = unit
        # First decode (n = P + q tokens): P + q <= B < P + q + L when L > 0, else P + q = B + 1.
        prompt = boundary - q - L + 1 if L else boundary - q + 1
        while prompt < 1:
            boundary += unit
            prompt = boundary - q - L + 1 if L else boundary - q + 1
        # The crossing decode ends at most q tokens past the boundary (boundary + 1 without
        # lookahead), and a step's tokens stay below max_model_len (the bonus token's position).
        need = max(boundary + q + L, boundary + 2)
        if need > M:
            plan.skipped.append(
                SkippedStep(
                    "block_boundary",
                    f"crossing a {unit}-token boundary needs {need} tokens > max_model_len={M}",
                )
            )
            return
        req = sim.new_request(prompt)
        chunk = self.config.scheduler.max_num_batched_tokens
        for start in range(0, prompt, chunk):
            e = _Entry(req, min(chunk, prompt - start), 0, start == 0)
            sim.run(
                f"boundary_prefill_{start // chunk}",
                "prefill",
                f"prompt of {prompt} tokens ending just "
                f"before the {boundary}-token block boundary (chunks of <= {chunk})",
                [e],
            )
        seen: set[str] = set()
        for i in range(4):
            e = _Entry(req, q, k, False)
            step = sim.run(
                f"boundary_decode_{i}",
                "decode",
                "decode across the block boundary" + (" (lookahead first, then tokens)" if L else ""),
                [e],
            )
            seen.update(step.requests[0].crossed.values())
            if "tokens" in seen:
                break

    def _mixed(self, sim: _Simulator, batch: list[Request]) -> None:
        """A prompt joining running decodes in one step; again over the latent/indexer caches."""
        k = self.k
        kinds = [("mixed_prefill_decode", "mixed", "a new prompt joins running decodes in one step")]
        if any(g.spec.kind in ("indexer", "mla") for g in self.groups):
            kinds.append(
                ("sparse_mla_mixed", "sparse_mla", "prefill + decode over the latent and indexer caches")
            )
        for name, kind, reason in kinds:
            req = sim.new_request(self.prompt_len)
            # The scheduler's order: running requests first, then the prompt that joins them (the
            # runner's rows follow it, so warmup captures and audits the layout serving emits).
            # Beside decodes a step computes at most the prompt allowance: the prompt's first chunk.
            cap = sim.builder.max_prefill_tokens_with_decodes
            joined = self.prompt_len if cap is None else min(self.prompt_len, cap)
            entries = [_Entry(r, 1 + k, k, False) for r in batch] + [_Entry(req, joined, 0, True)]
            sim.run(name, kind, reason, entries)
