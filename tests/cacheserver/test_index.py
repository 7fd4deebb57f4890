"""The server's bookkeeping (``kvlayer.cacheserver.index``) and the arena header, without processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlayer.cacheserver.arena import ArenaError, ArenaFile, check_header
from kvlayer.cacheserver.index import ALIGN, ChunkIndex, FreeList, Session
from kvlayer.cacheserver.protocol import Key, Status


def key(i: int, tokens: bytes = b"t" * 16) -> Key:
    return Key(i.to_bytes(32, "little"), tokens)


def store(index: ChunkIndex, session: Session, keys: list[Key], size: int = 1000) -> list[Status]:
    slots = index.reserve(session, [(k, size) for k in keys])
    done = [k.digest for k, s in zip(keys, slots) if s.status is Status.OK]
    assert index.commit(session, [(d, 0) for d in done]) == len(done)
    assert index.release(session, done) == len(done), "a commit is the writer's lease until it releases"
    return [s.status for s in slots]


def test_free_list_coalesces_back_to_one_range():
    space = FreeList(4096, 10 * ALIGN)
    starts = [space.allocate(ALIGN) for _ in range(10)]
    assert starts == [4096 + i * ALIGN for i in range(10)] and space.allocate(1) is None
    for s in starts[::2] + starts[1::2]:  # freed out of order
        space.free(s, ALIGN)
    assert space.used == 0 and space.allocate(10 * ALIGN) == 4096


def test_sizes_round_up_and_ranges_never_overlap():
    space = FreeList(0, 64 * ALIGN)
    a, b = space.allocate(1), space.allocate(ALIGN + 1)
    assert (a, b) == (0, ALIGN) and space.used == 3 * ALIGN


def test_eviction_is_lru_and_spares_leased_chunks_and_the_batch():
    index = ChunkIndex(0, 4 * 1024)  # room for 4 chunks of 1000 (1024 with alignment)
    s = Session()
    assert store(index, s, [key(i) for i in range(4)]) == [Status.OK] * 4
    index.lease(s, [key(0)])  # the oldest, but leased
    assert store(index, s, [key(4)]) == [Status.OK]
    assert index.lookup([key(0)]) == 1 and index.lookup([key(1)]) == 0  # key 1 went, not the leased key 0
    # a batch larger than what can be evicted: FULL from the first item without room, never its own chunks
    assert store(index, s, [key(i) for i in range(10, 15)]) == [Status.OK] * 3 + [Status.FULL] * 2
    assert index.used <= index.capacity and index.refused == 1 and index.evictions == 4


def test_a_batch_keeps_its_head_longest():
    index = ChunkIndex(0, 3 * 1024)
    s = Session()
    store(index, s, [key(0), key(1), key(2)])
    index.lookup([key(0), key(1), key(2)])
    store(index, s, [key(9)])
    assert index.lookup([key(0), key(1)]) == 2 and index.lookup([key(2)]) == 0  # the tail went first


def test_present_reserved_and_foreign_tokens():
    index = ChunkIndex(0, 8 * 1024)
    a, b = Session(), Session()
    assert index.reserve(a, [(key(1), 100)])[0].status is Status.OK
    assert index.lookup([key(1)]) == 0  # reserved is invisible
    assert index.reserve(b, [(key(1), 100)])[0].status is Status.PRESENT
    assert index.commit(b, [(key(1).digest, 5)]) == 0  # not b's reservation
    assert index.commit(a, [(key(1).digest, 5)]) == 1
    assert index.lookup([key(1, b"x" * 16)]) == 0  # other tokens under the same digest: a miss
    assert index.lease(b, [key(1, b"x" * 16)])[0].status is Status.MISSING
    lease = index.lease(b, [key(1)])[0]
    assert lease.status is Status.OK and lease.size == 100 and lease.checksum == 5
    assert index.remove([key(1).digest]) == 0  # leased: stays
    assert index.release(b, [key(1).digest, key(1).digest]) == 1  # one lease, released once
    assert index.remove([key(1).digest]) == 0  # its writer's lease (the commit) still holds it
    assert index.release(a, [key(1).digest]) == 1
    assert index.remove([key(1).digest]) == 1 and index.used == 0


def test_sizes_outside_the_arena_are_refused():
    index = ChunkIndex(0, 4096)
    for size in (0, 4097):
        with pytest.raises(ValueError):
            index.reserve(Session(), [(key(1), size)])
    assert index.used == 0


def test_a_session_that_ends_gives_everything_back():
    index = ChunkIndex(0, 16 * 1024)
    keeper, gone = Session(), Session()
    store(index, keeper, [key(0)])
    before = (index.used, index.counts())
    store(index, gone, [key(1)])
    index.lease(gone, [key(0), key(1), key(1)])
    index.reserve(gone, [(key(2), 1000)])
    assert index.counts() == (2, 1, 3)
    index.end(gone)
    assert index.counts() == (2, 0, 0)  # key 1 stays stored: it was committed
    assert index.remove([key(1).digest]) == 1
    assert (index.used, index.counts()) == before


def test_an_arena_header_of_another_epoch_is_refused(tmp_path):
    arena = ArenaFile.create(str(tmp_path / "s.sock"), 8192, folder=tmp_path)
    head = Path(arena.path).read_bytes()[:4096]
    check_header(head, arena.epoch, arena.size, arena.data_offset)
    with pytest.raises(ArenaError, match="epoch"):
        check_header(head, arena.epoch + 1, arena.size, arena.data_offset)
    with pytest.raises(ArenaError, match="not a kvlayer"):
        check_header(b"\0" * 4096, arena.epoch, arena.size, arena.data_offset)
    again = ArenaFile.create(str(tmp_path / "s.sock"), 8192, folder=tmp_path)  # a new server, same socket
    assert [p.name for p in tmp_path.iterdir()] == [again.path.rsplit("/", 1)[1]]  # the stale file is gone
    assert oct((tmp_path / again.path.rsplit("/", 1)[1]).stat().st_mode & 0o777) == "0o600"


def test_a_committed_chunk_is_not_evicted_while_its_writer_still_holds_it():
    index = ChunkIndex(0, 2 * 1024)  # room for 2 chunks of 1000
    writer, other = Session(), Session()
    mine = [key(1), key(2)]
    slots = index.reserve(writer, [(k, 1000) for k in mine])
    assert index.commit(writer, [(k.digest, 0) for k in mine]) == 2 and index.lookup(mine) == 2
    assert [s.status for s in index.reserve(other, [(key(3), 1000)])] == [Status.FULL], \
        "the writer may still be copying them to a lower tier"
    index.release(writer, [mine[0].digest])
    assert [s.status for s in index.reserve(other, [(key(3), 1000)])] == [Status.OK]
    assert index.lookup(mine) == 0 and index.lookup(mine[1:]) == 1 and slots[0].status is Status.OK
