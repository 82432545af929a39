"""Two ranks with uneven attention heads even out their work (``models/llama.py`` KVOffload): rank 1
projects rank 0's K/V too and posts them through the shared-memory mailbox. The logits are the
bits of each rank projecting its own heads, the engine's tokens TP=1's, eagerly and replaying
recorded CPU graphs, and a pass too large for the mailbox falls back on both ranks alike."""

from __future__ import annotations

import pytest
import torch
from tp_ranks import greedy_logits, kv_offload_greedy, save_tiny

from warmcap.contracts.parallel import ParallelState, set_parallel_state
from warmcap.distributed import rendezvous_for, run_on_ranks
from warmcap.llm import LLM
from warmcap.models.llama import KVOffload, kv_offload_plan
from warmcap.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 7, 41], [300, 12], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
STEPS = 4
#: tokens in the first (prefill) pass and in each decode pass of the harness
PREFILL, DECODE = sum(map(len, PROMPTS)), len(PROMPTS)


class _Mailbox:
    """A communicator stand-in with a mailbox of ``mail_floats`` floats."""

    name = "shm"
    replayable = True

    def __init__(self, mail_floats: int) -> None:
        self.mail_floats = mail_floats


@pytest.fixture
def two_ranks_with_mail():
    def state(rank: int = 0, world: int = 2, mail: int = 1 << 20) -> ParallelState:
        st = ParallelState(rank, world, comm=_Mailbox(mail))
        set_parallel_state(st)
        return st

    yield state
    set_parallel_state(None)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "want"),
    [
        # SmolLM2-135M: rank 0 held 16 [hidden x head_dim] slices, rank 1 8; both 12 after
        (9, 3, KVOffload(0, 1, 0, 2)),
        (6, 3, KVOffload(0, 1, 0, 2)),
        # SmolLM2-360M (15 / 5): rank 0 3 groups, rank 1 2: 24 / 16 -> 18 / 22
        (15, 5, KVOffload(0, 1, 0, 3)),
        # even splits need nothing
        (4, 2, None),
        (32, 8, None),
        # one query head a group: rank 0's 2 x 2 K/V slices would make rank 1 the busier (8 vs 4)
        (3, 3, None),
        # one KV head over two ranks: replicated, even
        (4, 1, None),
    ],
)
def test_plan_offloads_the_busier_ranks_kv_only_where_it_evens_the_work(
    heads, kv_heads, want, two_ranks_with_mail
):
    assert kv_offload_plan(heads, kv_heads, two_ranks_with_mail()) == want


def test_no_plan_without_a_mailbox_or_with_other_than_two_ranks(two_ranks_with_mail):
    assert kv_offload_plan(9, 3, two_ranks_with_mail(mail=0)) is None
    assert kv_offload_plan(9, 3, two_ranks_with_mail(world=3)) is None
    set_parallel_state(None)
    assert kv_offload_plan(9, 3, ParallelState()) is None


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> str:
    """6 query heads over 3 KV heads (head size 16): rank 0 holds 2 groups, rank 1 one."""
    out = tmp_path_factory.mktemp("llama6q3kv")
    return str(
        save_tiny(
            out, "tiny-llama", "LlamaForCausalLM", hidden_size=96, num_attention_heads=6,
            num_key_value_heads=3, head_dim=16,
        )
    )  # fmt: skip


def _ranks(model: str, mode: str, mail_tokens: int | None = None) -> list[dict]:
    return run_on_ranks(
        kv_offload_greedy, rendezvous_for(2), model, PROMPTS, STEPS, mode, mail_tokens, timeout_s=180
    )


@pytest.mark.slow
def test_offloaded_kv_gives_each_rank_the_bits_of_its_own_heads(uneven):
    one = greedy_logits(uneven, PROMPTS, STEPS, packed=True)
    off = _ranks(uneven, "heads")
    on = _ranks(uneven, "auto")
    layers = len(on[0]["offload_on"])
    for rank in (0, 1):
        assert all(on[rank]["offload_on"]) and not any(off[rank]["offload_on"]), rank
        assert torch.equal(on[rank]["logits"], off[rank]["logits"]), rank
        assert on[rank]["tokens"] == one["tokens"], rank
    # every pass of every layer went through the mailbox, and each message was taken once
    assert on[0]["posted"] == on[0]["taken"] == STEPS * layers
    assert off[0]["posted"] == off[0]["taken"] == 0
    # rank 0 caches its own 2 KV heads either way; rank 1 its one
    assert on[0]["kv_heads"] == [2] and on[1]["kv_heads"] == [1]


@pytest.mark.slow
def test_a_pass_too_large_for_the_mailbox_projects_kv_on_the_giver(uneven):
    """A mailbox of 8 tokens: the 22-token prefill is projected by rank 0 itself (both ranks
    decide so from the token count), the 3-token decodes go through the mailbox; same bits."""
    off = _ranks(uneven, "heads")
    small = _ranks(uneven, "auto", mail_tokens=8)
    assert PREFILL > 8 >= DECODE
    layers = len(small[0]["offload_on"])
    assert small[0]["posted"] == small[0]["taken"] == (STEPS - 1) * layers
    for rank in (0, 1):
        assert torch.equal(small[rank]["logits"], off[rank]["logits"]), rank


@pytest.mark.slow
@pytest.mark.parametrize("eager", [True, False])
def test_the_engine_with_the_offload_generates_tp1s_tokens(uneven, eager):
    """Through ``LLM``: eager steps, and recorded CPU graphs whose replay makes the mailbox's C
    calls (every graph records; verified against eager at start-up)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    small = {"max_model_len": 128, "max_num_seqs": 4, "enforce_eager": eager}
    one = LLM(uneven, **small)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy)]
    finally:
        one.shutdown()
    llm = LLM(uneven, tensor_parallel_size=2, **small)
    try:
        from warmcap.contracts.parallel import parallel_state
        from warmcap.distributed.shm_segment import MAIL

        attention = [m for m in llm.engine.runner.model.modules() if hasattr(m, "kv_offload_on")]
        assert attention and all(m.kv_offload_on for m in attention)
        seg = parallel_state().comm.seg
        before = seg.get(1, MAIL)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        assert seg.get(1, MAIL) > before
        if not eager:
            graphs = [
                g
                for by_descriptor in llm.engine.runner.graphs._graphs.values()
                for g in by_descriptor.values()
            ]
            assert graphs and all(g.program is not None for g in graphs), [g.not_recorded for g in graphs]
            assert sum(llm.engine.runner.graphs.replays.values()) > 0
    finally:
        llm.shutdown()
    assert got == want


def test_mailbox_messages_arrive_in_order_and_a_peer_leaving_ends_the_wait():
    from tp_ranks import mailbox_messages

    zero, _ = run_on_ranks(mailbox_messages, rendezvous_for(2), 5, timeout_s=120)
    for i, message in enumerate(zero["got"]):
        assert torch.equal(message, torch.arange(15, dtype=torch.float32).view(3, 5) + 100 * i), i
    assert len(zero["got"]) == 5
    # the wait checks its peers every 10 ms: a peer that left ends it at once, not at the timeout
    assert zero["error"] == "tensor-parallel rank 1 left the group"
    assert zero["seconds"] < 1.0
