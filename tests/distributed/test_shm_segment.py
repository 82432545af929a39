"""Waiting on a peer in shared memory never outlives the peer: a wait ends soon after the peer's
process dies or it leaves the group, a deadline ends it otherwise, and a segment leaves no name
behind once its ranks have mapped it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import pytest

from warmcap.distributed.shm_segment import (
    CHECK_S,
    SEQ,
    SHM_DIR,
    Layout,
    PeerGoneError,
    Segment,
    pid_alive,
)

#: a small segment: these tests are about the header, not the data
LAYOUT = Layout(2, data_bytes=4096, ring_slots=2, ring_slot_bytes=4096)


def _peer_main(name: str, how: str, ready: Connection) -> None:
    """Rank 1: map the segment, publish collective 1, then sleep (to be killed) or leave."""
    seg = Segment.attach(1, name, LAYOUT, 5.0)
    seg.set(SEQ, 1)
    ready.send("attached")
    if how == "leave":
        time.sleep(0.5)
        seg.close()
    time.sleep(600)


def _peer(name: str, how: str) -> BaseProcess:
    # NOTE: forked, not spawned: a spawned interpreter importing torch takes tens of seconds on a
    # loaded machine, and this child touches nothing but the segment.
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(name, how, theirs), daemon=True)
    proc.start()
    assert ours.poll(30) and ours.recv() == "attached"
    return proc


@pytest.fixture
def segment():
    seg = Segment.create(LAYOUT, timeout_s=60.0)
    try:
        yield seg
    finally:
        seg.unlink()
        seg.close()


def test_a_wait_ends_soon_after_the_peer_is_killed(segment):
    peer = _peer(segment.name, "sleep")
    try:
        segment.wait_at_least(1, SEQ, 1)  # already there: returns at once
        time.sleep(0.3)
        os.kill(peer.pid, signal.SIGKILL)
        killed = time.monotonic()
        # NOTE: the peer stays a zombie until joined (as a killed spawned worker does): gone too.
        with pytest.raises(PeerGoneError, match=r"rank 1 is gone \(its process \d+ exited\)") as err:
            segment.wait_at_least(1, SEQ, 2)
        assert err.value.rank == 1
        assert time.monotonic() - killed < 1.0
        assert not pid_alive(peer.pid)
    finally:
        peer.kill()
        peer.join()


def test_a_wait_ends_when_the_peer_leaves_the_group(segment):
    peer = _peer(segment.name, "leave")
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerGoneError, match="rank 1 left the group"):
            segment.wait_at_least(1, SEQ, 2)
        assert time.monotonic() - t0 < 0.5 + 1.0
        assert pid_alive(peer.pid)
    finally:
        peer.kill()
        peer.join()


def test_a_wait_on_a_live_but_silent_peer_times_out(segment):
    peer = _peer(segment.name, "sleep")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"waited [\d.]+ s in shared memory"):
            segment.wait_at_least(1, SEQ, 2, timeout_s=0.2)
        assert 0.2 <= time.monotonic() - t0 < 0.2 + 1.0 + CHECK_S
    finally:
        peer.kill()
        peer.join()


def test_the_segment_is_named_for_its_creator_and_can_lose_its_name_while_mapped(segment):
    assert segment.name.startswith(f"warmcap-{os.getpid()}-")
    assert (SHM_DIR / segment.name).exists()
    peer = _peer(segment.name, "sleep")
    try:
        segment.unlink()
        assert not (SHM_DIR / segment.name).exists()
        # Both mappings still work after the name is gone.
        segment.wait_at_least(1, SEQ, 1)
    finally:
        peer.kill()
        peer.join()


def _lagging_peer_main(name: str, delays: list[float]) -> None:
    """Rank 1: answer rank 0's collective k ``delays[k - 1]`` seconds after it arrives, busy all
    the while (a peer that slept would add its own wake-up to rank 0's waits)."""
    seg = Segment.attach(1, name, LAYOUT, 30.0)
    clock = time.perf_counter
    for k, delay in enumerate(delays, start=1):
        while seg.get(0, SEQ) < k:
            pass
        end = clock() + delay
        while clock() < end:
            pass
        seg.set(SEQ, k)
    time.sleep(600)


def test_spin_gives_the_core_away_when_the_peer_lags_and_returns_when_it_keeps_pace(segment):
    """A rank whose peer keeps arriving long after it starts waiting stops spinning (on a busy
    machine the spin burns the core another task needs); once the peer arrives within the spin
    again (here a tenth of a millisecond late, as a rank with fewer heads waits for one with more),
    it spins again (on a quiet machine that saves a futex wake-up at every collective)."""
    from warmcap.distributed.shm_segment import SPIN_MAX_S

    lagging, keeping_pace = [20 * SPIN_MAX_S] * 12, [SPIN_MAX_S / 5] * 12
    peer = mp.get_context("fork").Process(
        target=_lagging_peer_main, args=(segment.name, lagging + keeping_pace), daemon=True
    )
    peer.start()
    try:
        spinning = []
        for k in range(1, len(lagging) + len(keeping_pace) + 1):
            segment.set(SEQ, k)
            segment.wait_at_least(1, SEQ, k)
            spinning.append(segment._spinning)
        assert not spinning[len(lagging) - 1], "still spinning after a run of long waits"
        assert spinning[-1], "not spinning again after a run of waits the peer ended at once"
    finally:
        peer.kill()
        peer.join()
