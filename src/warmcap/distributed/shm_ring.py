"""Rank 0's commands to the workers of one machine as a ring of shared-memory slots.

One writer (rank 0), every other rank a reader. Message ``s`` (1, 2, ...) goes in slot
``(s - 1) % slots``: rank 0 waits until every reader has read message ``s - slots`` (the slot is
free), writes the length and the bytes, then publishes its sent count; a reader waits for the sent
count to reach the message it expects, copies the bytes out and publishes its read count. So rank 0
runs up to ``slots`` messages ahead and never waits for a reader that keeps up; a reader waiting
for the next command sleeps (see ``shm_segment.Segment.wait_idle``) and wakes within a few ms.

A message larger than a slot is announced with length -1 and travels over the gloo broadcast
(``channel.py``) instead.
"""

from __future__ import annotations

from warmcap.distributed.shm_segment import READ, SENT, Segment

#: bytes before a slot's payload (its length word, padded to a cache line)
SLOT_HEADER = 64
#: the length that says "this message follows over gloo"
OVERSIZE = -1


class ShmRing:
    """This rank's end of the command ring of ``segment`` (rank 0 writes, the others read)."""

    def __init__(self, segment: Segment) -> None:
        self.seg = segment
        lay = segment.layout
        self.slots = lay.ring_slots
        self.max_bytes = lay.ring_slot_bytes - SLOT_HEADER
        self._offsets = [lay.slot_at(i) for i in range(self.slots)]
        self._count = 0
        self._view = memoryview(segment.buf)

    def send(self, payload: bytes | None) -> None:
        """Rank 0: the next message; None (or too large) announces one that follows over gloo."""
        seg = self.seg
        s = self._count + 1
        if s > self.slots:
            for r in range(1, seg.layout.world_size):
                seg.wait_at_least(r, READ, s - self.slots)
        off = self._offsets[(s - 1) % self.slots]
        if payload is None or len(payload) > self.max_bytes:
            seg.words[off // 8] = OVERSIZE
        else:
            seg.words[off // 8] = len(payload)
            self._view[off + SLOT_HEADER : off + SLOT_HEADER + len(payload)] = payload
        seg.set(SENT, s)
        self._count = s

    def recv(self) -> bytes | None:
        """A worker: the next message's bytes, or None when it follows over gloo; waits as long as
        rank 0 is alive and in the group."""
        seg = self.seg
        s = self._count + 1
        seg.wait_idle(0, SENT, s)
        off = self._offsets[(s - 1) % self.slots]
        n = seg.words[off // 8]
        payload = None if n == OVERSIZE else bytes(self._view[off + SLOT_HEADER : off + SLOT_HEADER + n])
        seg.set(READ, s)
        self._count = s
        return payload

    def release(self) -> None:
        self._view.release()
