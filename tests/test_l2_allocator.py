"""BlockAllocator: lifecycle, reuse of freed blocks, exhaustion leaving the pool consistent."""
import pytest

from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l2_token_flat.request import Request
from shared.errors import PoolExhausted


@pytest.mark.task("L2.1")
def test_alloc_and_free_round_trip():
    a = BlockAllocator(8)
    got = a.alloc(3)
    assert len(set(got)) == 3 and all(0 <= b < 8 for b in got), (
        f"alloc(3) of an 8-block pool gave {got}: want 3 distinct ids in 0..7")
    assert a.num_free == 5, f"after alloc(3) of 8 blocks num_free is {a.num_free}, want 5"
    a.free(got)
    assert a.num_free == 8, f"after freeing them again num_free is {a.num_free}, want 8"


@pytest.mark.task("L2.1")
def test_freed_blocks_are_reused():
    a = BlockAllocator(4)
    first = a.alloc(4)
    a.free(first[:2])
    again = a.alloc(2)
    assert sorted(again) == sorted(first[:2]), (
        f"with only {first[:2]} freed, alloc(2) gave {again}: want those two back")
    assert a.num_free == 0, f"every block is held again, yet num_free is {a.num_free}"


@pytest.mark.task("L2.1")
def test_exhaustion_names_needed_and_free_and_changes_nothing():
    a = BlockAllocator(5)
    held = a.alloc(3)
    with pytest.raises(PoolExhausted, match=r"need 4 block\(s\), 2 of 5 free"):
        a.alloc(4)
    assert a.num_free == 2, f"a failed alloc(4) must take nothing (all or nothing): num_free went 2 -> {a.num_free}"
    rest = a.alloc(2)
    assert sorted(held + rest) == list(range(5)), (
        f"alloc(3) then alloc(2) of 5 blocks gave {held} and {rest}: want 0..4 once each")


@pytest.mark.task("L2.2")
def test_reserve_failure_leaves_request_and_pool_intact():
    a = BlockAllocator(4)
    req = Request([1] * 4, block_size=4)
    req.reserve(4, a)  # 1 block, 3 left
    blocks = list(req.blocks)
    try:
        req.reserve(20, a)  # 5 blocks: 4 more, with 3 free
    except PoolExhausted:
        pass
    else:
        pytest.fail(f"reserve(20) at S=4 needs 4 more blocks with 3 free: it must raise PoolExhausted, and gave the "
                    f"block table {req.blocks}")
    assert req.blocks == blocks and a.num_free == 3, (
        f"a reserve that raises PoolExhausted must change nothing (all or nothing): the request's blocks went "
        f"{blocks} -> {req.blocks}, the allocator's free count 3 -> {a.num_free}")
    a.free(req.blocks)
    assert a.num_free == 4


@pytest.mark.task("L2.1")
def test_double_free_is_caught():
    a = BlockAllocator(2)
    b = a.alloc(1)
    a.free(b)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(b)
    assert a.num_free == 2, f"a refused double free changed num_free to {a.num_free}, want 2"


@pytest.mark.parametrize("bad, error", [([0, 0], "freed twice"), ([-1], "not in this pool"),
                                        ([4], "not in this pool"), ([1, 4], "not in this pool")])
@pytest.mark.task("L2.1")
def test_free_rejects_repeats_and_out_of_range_ids_and_changes_nothing(bad, error):
    a = BlockAllocator(4)
    a.alloc(2)  # blocks 0 and 1 held; 2 and 3 free (so -1, read as block 3, looked free before the fix)
    with pytest.raises(ValueError, match=error):
        a.free(bad)
    assert a.num_free == 2, (
        f"free({bad}) raised but changed num_free 2 -> {a.num_free}: check every id before freeing any")
    assert a.alloc(2) == [2, 3], f"after the refused free({bad}) the free list is not [2, 3] as before"


@pytest.mark.task("L2.1")
def test_a_freed_block_is_reused_last():
    a = BlockAllocator(4)
    a.alloc(3)  # 0, 1, 2
    a.free([1, 0])
    # The never-used 3 comes first, then the freed ones in the order they were freed.
    got = a.alloc(3)
    assert got == [3, 1, 0], (f"after alloc(3) = [0, 1, 2] of 4 and free([1, 0]), alloc(3) gave {got}: want [3, 1, 0], "
                              "the never-used 3 first, then the freed blocks in the order freed (to the back of the "
                              "free list: reused last)")
