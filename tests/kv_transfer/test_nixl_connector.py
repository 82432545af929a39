"""NixlConnector between two engines in one process (real NIXL agents over UCX, CPU memory): D
reads P's blocks and decodes exactly as a standalone engine; P holds the blocks until D's read (or a
timeout), never less; a failed transfer ends its request with a clear error and frees its blocks on
both sides."""

from __future__ import annotations

import random
import socket
import time

import pytest

from warmcap.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StartupOptions,
)
from warmcap.engine import LLMEngine
from warmcap.errors import ConfigError, NonFiniteLogitsError
from warmcap.outputs import RequestOutput
from warmcap.sampling_params import SamplingParams
from warmcap.serve.poison import poison_free_blocks

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1)


def _engine(
    role: str | None, spec: str | None = None, *, hooks: bool = False, audit: bool = False, **extra
) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
        speculative=SpeculativeConfig.parse(spec) if spec else None,
        kv_transfer=KVTransferConfig("NixlConnector", role, kv_connector_extra_config=extra)
        if role
        else None,
    )
    return LLMEngine(config, startup=StartupOptions(audit_serving=audit), startup_hooks=None if hooks else [])


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _prefill(p: LLMEngine, prompt: list[int], req_id: str = "p") -> dict:
    """P's answer for ``prompt``: the finished one-token request's transfer parameters."""
    p.add_request(
        {"prompt_token_ids": prompt}, PREFILL, req_id, kv_transfer_params={"do_remote_decode": True}
    )
    while True:
        for out in p.step():
            if out.finished:
                assert out.kv_transfer_params is not None
                return out.kv_transfer_params


def _decode(d: LLMEngine, prompt: list[int], params: dict | None, req_id: str, p: LLMEngine) -> RequestOutput:
    """D's answer; P steps alongside, as its server would (it drives its side of the transfer)."""
    d.add_request({"prompt_token_ids": prompt}, GREEDY, req_id, kv_transfer_params=params)
    while True:
        p.step()
        for out in d.step():
            if out.finished and out.request_id == req_id:
                return out


def _per_pos(engine: LLMEngine) -> list[int]:
    """Accepted drafts per position so far (k = 2 positions)."""
    counts = list(engine.spec_metrics.accepted_per_pos)
    return counts + [0] * (2 - len(counts))


def _held(engine: LLMEngine) -> int:
    return engine.num_blocks - 1 - engine.kv_cache_manager.pool.num_free_blocks


def _drain(engine: LLMEngine, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while engine.has_unfinished() and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.005)


@pytest.fixture(scope="module")
def pair() -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    # P has D's --spec: its drafter writes the prompt's drafter KV (and proposes nothing), which
    # travels with the target's.
    spec = "draft_model:2"
    return _engine("kv_producer", spec), _engine("kv_consumer", spec), _engine(None, spec)


def test_d_reads_p_blocks_and_decodes_as_a_standalone_engine(pair) -> None:
    p, d, s = pair
    for i, n in enumerate((17, 40, 48)):
        prompt = _prompt(n, seed=i)
        params = _prefill(p, prompt, f"p{i}")
        assert set(params["remote_block_ids"]) == {"full", "draft.full"}
        # P keeps the blocks for D: stepping P alone never frees them.
        held = _held(p)
        for _ in range(3):
            p.step()
        assert _held(p) == held > 0
        before = _per_pos(d), _per_pos(s)
        got = _decode(d, prompt, params, f"d{i}", p)
        (want,) = s.generate([{"prompt_token_ids": prompt}], [GREEDY])
        assert got.error is None and got.outputs[0].token_ids == want.outputs[0].token_ids
        d_pos = [a - b for a, b in zip(_per_pos(d), before[0], strict=True)]
        s_pos = [a - b for a, b in zip(_per_pos(s), before[1], strict=True)]
        assert d_pos == s_pos and sum(s_pos) > 0
        # D's read notified P, which now frees the blocks.
        _drain(p)
        assert _held(p) == 0 and _held(d) == 0
    assert d.kv_connector_worker.stats.num_reads == 3


def test_a_prompt_with_nothing_to_read_lets_p_free_at_once(pair) -> None:
    p, d, s = pair
    prompt = [42]  # its one token is computed on D: no block to read
    got = _decode(d, prompt, _prefill(p, prompt, "p-one"), "d-one", p)
    (want,) = s.generate([{"prompt_token_ids": prompt}], [GREEDY])
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    _drain(p, 5)
    assert _held(p) == 0 and _held(d) == 0


def test_poisoned_free_blocks_change_nothing_but_catch_kv_never_loaded(pair) -> None:
    p, d, s = pair
    prompt = _prompt(40, seed=7)
    (want,) = s.generate([{"prompt_token_ids": prompt}], [GREEDY])
    assert poison_free_blocks(d) > 0
    got = _decode(d, prompt, _prefill(p, prompt, "p-poison"), "d-poison", p)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # Without a transfer the "loaded" blocks still hold NaN at visible positions: no token can be
    # sampled, and the engine says so for that request.
    fresh = _engine(None, "draft_model:2")
    assert poison_free_blocks(fresh) > 0
    fresh.add_request({"prompt_token_ids": prompt}, GREEDY, "never-loaded", num_external_computed_tokens=39)
    with pytest.raises(NonFiniteLogitsError, match=r"non-finite logits .*\(never-loaded\)"):
        _outputs(fresh)
    _drain(p)
    assert _held(p) == 0 and _held(d) == 0


def _outputs(engine: LLMEngine) -> list[RequestOutput]:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def _assert_failed(out: RequestOutput, match: str) -> None:
    assert out.finished and out.error is not None and match in out.error, out.error


def test_a_wrong_engine_id_ends_the_request_and_frees_both_sides(pair) -> None:
    p, d, s = pair
    prompt = _prompt(33, seed=3)
    params = _prefill(p, prompt, "p-wrong-id")
    _assert_failed(
        _decode(d, prompt, {**params, "remote_engine_id": "nobody"}, "d-wrong-id", p), "does not match"
    )
    assert _held(d) == 0
    # D told P it will not read: P frees at once, long before its 120 s deadline.
    _drain(p, 5)
    assert _held(p) == 0
    # Both go on serving.
    (want,) = s.generate([{"prompt_token_ids": prompt}], [GREEDY])
    got = _decode(d, prompt, _prefill(p, prompt, "p-after"), "d-after", p)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_block_ids_that_do_not_match_the_prompt_end_the_request(pair) -> None:
    p, d, _ = pair
    params = _prefill(p, _prompt(20, seed=4), "p-short")
    # The same P blocks offered for a longer prompt: they cannot hold its KV.
    longer = _prompt(60, seed=4)
    _assert_failed(
        _decode(d, longer, {**params, "remote_num_tokens": None}, "d-short", p),
        "do not belong to this prompt",
    )
    # P's prompt length differs from D's: refused before any block is read.
    _assert_failed(_decode(d, longer, params, "d-len", p), "computed 20 prompt tokens but this prompt has 60")
    _drain(p, 5)
    assert _held(p) == 0 and _held(d) == 0


def test_an_unreachable_producer_ends_the_request(pair) -> None:
    p, d, _ = pair
    prompt = _prompt(30, seed=5)
    params = _prefill(p, prompt, "p-gone")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    _assert_failed(_decode(d, prompt, {**params, "remote_port": closed}, "d-gone", p), "cannot reach")
    assert _held(d) == 0
    _drain(p, 0.2)
    assert _held(p) > 0  # P never heard from D: it keeps the blocks until its deadline


def test_p_frees_unread_blocks_only_after_its_timeout() -> None:
    p = _engine("kv_producer", abort_request_timeout=1.0)
    _prefill(p, _prompt(40), "unread")
    finished = time.monotonic()
    assert _held(p) > 0
    while _held(p) and time.monotonic() - finished < 10:
        p.step()
        time.sleep(0.01)
    assert _held(p) == 0 and time.monotonic() - finished >= 1.0


def test_a_producer_runs_its_drafters_prompt_pass_and_proposes_nothing(pair, monkeypatch) -> None:
    p, _, s = pair
    assert p.drafter is not None and p.config.num_lookahead_tokens == 0
    proposals: list[dict] = []
    propose = p.drafter.propose

    def spy(*args: object) -> object:
        drafts = propose(*args)
        proposals.append(drafts.to_lists())
        return drafts

    monkeypatch.setattr(p.drafter, "propose", spy)
    before = p.spec_metrics.num_drafts, p.spec_metrics.num_draft_tokens
    held = _held(p)  # an earlier test's unread blocks may still wait for their deadline
    # A whole generation on P: its drafter runs every step and never drafts a token.
    prompt = _prompt(37, seed=8)
    (got,) = p.generate([{"prompt_token_ids": prompt}], [GREEDY])
    (want,) = s.generate([{"prompt_token_ids": prompt}], [GREEDY])
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert proposals and all(proposal == {} for proposal in proposals)
    assert (p.spec_metrics.num_drafts, p.spec_metrics.num_draft_tokens) == before
    assert _held(p) == held


def _refused(p: LLMEngine, d: LLMEngine, *parts: str) -> None:
    prompt = _prompt(33, seed=6)
    out = _decode(d, prompt, _prefill(p, prompt, "p-mismatch"), "d-mismatch", p)
    for part in (*parts, "start the prefill server with the same --spec"):
        _assert_failed(out, part)
    _drain(p, 5)
    assert _held(p) == 0 and _held(d) == 0


def test_a_producer_without_the_consumers_drafter_is_refused(pair) -> None:
    _, d, _ = pair
    _refused(
        _engine("kv_producer"),
        d,
        "runs --spec none (no drafter KV)",
        "this decode instance runs --spec draft_model:2",
    )


def test_a_producer_with_another_drafter_is_refused() -> None:
    p, d = _engine("kv_producer", "eagle:3"), _engine("kv_consumer", "dflash:7")
    _refused(p, d, "runs --spec eagle:3", "this decode instance runs --spec dflash:7")
    # The same pair, set up alike, transfers.
    d = _engine("kv_consumer", "eagle:3")
    prompt = _prompt(33, seed=9)
    got = _decode(d, prompt, _prefill(p, prompt, "p-same"), "d-same", p)
    assert got.error is None


def test_transfer_params_are_checked_before_a_request_is_queued(pair) -> None:
    p, d, s = pair
    with pytest.raises(ConfigError, match=r"lacks \['remote_engine_id'"):
        d.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(ConfigError, match="needs a prefill instance"):
        d.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ConfigError, match="needs a decode instance"):
        s.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY, kv_transfer_params=_prefill(p, [5, 6, 7]))
    assert not d.has_unfinished() and not s.has_unfinished()
    _drain(p, 0.1)


def test_a_group_kind_that_cannot_move_is_refused_at_start_up() -> None:
    config = EngineConfig(
        model=ModelConfig(model="tiny-hybrid", device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=32),
        scheduler=SchedulerConfig(max_model_len=128),
        kv_transfer=KVTransferConfig("NixlConnector", "kv_consumer"),
    )
    with pytest.raises(ConfigError, match=r"cannot transfer KV groups of kind \['mamba'\]"):
        LLMEngine(config, startup_hooks=[])


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["dflash:7", "eagle:8"])
def test_seed_cases_start_up_and_serve_with_no_stray_write(spec: str) -> None:
    # The reference engine's two deterministic seed cases (block 16): audited warmup, audited serving.
    d = _engine("kv_consumer", spec, hooks=True, audit=True)
    assert d.warmup_result is not None and d.warmup_result.audit.ok
    # kv_both: P decodes too, so its drafter drafts; its prompt KV is the same a producer's.
    p = _engine("kv_both", spec)
    s = _engine(None, spec)
    for i, n in enumerate((16, 31, 47)):
        prompt = _prompt(n, seed=10 + i)
        got = _decode(d, prompt, _prefill(p, prompt, f"p{i}"), f"d{i}", p)
        (want,) = s.generate([{"prompt_token_ids": prompt}], [GREEDY])
        assert got.error is None and got.outputs[0].token_ids == want.outputs[0].token_ids
    assert (
        d.serving_audit is not None and d.serving_audit.totals.ok and d.serving_audit.totals.slots_checked > 0
    )
    _drain(p)
    assert _held(p) == 0 and _held(d) == 0


def test_a_read_in_one_block_chunks_decodes_as_standalone_and_frees_p_once(pair) -> None:
    p, _, s = pair
    d = _engine("kv_consumer", "draft_model:2", read_chunk_blocks=1)
    prompt = _prompt(50, seed=11)  # 3 full blocks and a partial one, in two groups: 8 READs
    held = _held(p)  # an earlier test's unread blocks may still wait for their deadline
    got = _decode(d, prompt, _prefill(p, prompt, "p-chunks"), "d-chunks", p)
    (want,) = s.generate([{"prompt_token_ids": prompt}], [GREEDY])
    assert got.error is None and got.outputs[0].token_ids == want.outputs[0].token_ids
    assert d.kv_connector_worker.stats.num_reads == 1
    _drain(p)
    assert _held(p) == held and _held(d) == 0


@pytest.mark.parametrize("value", [0, 1.5, True])
def test_read_chunk_blocks_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ConfigError, match=f"read_chunk_blocks must be a positive integer; got {value!r}"):
        _engine("kv_consumer", read_chunk_blocks=value)
