"""Chunk arithmetic: our padding must agree with torch.chunk, which is what Shard(0) means."""

import pytest
import torch

from dtensor_fsdp._tensor_utils import (
    alloc_storage,
    chunk_rows,
    free_storage,
    is_storage_freed,
    local_rows,
    padded_shard_nbytes,
)


@pytest.mark.parametrize("dim0", [1, 2, 3, 5, 7, 8, 13, 64, 1000])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 1024])
def test_local_rows_match_torch_chunk(dim0: int, world_size: int) -> None:
    chunks = torch.arange(dim0).chunk(world_size)
    expected = [len(c) for c in chunks] + [0] * (world_size - len(chunks))
    assert [local_rows(dim0, world_size, r) for r in range(world_size)] == expected
    assert sum(expected) == dim0
    assert chunk_rows(dim0, world_size) == max(expected)


def test_padded_shard_nbytes() -> None:
    # 13 rows over 4 ranks: chunks of 4 rows (4, 4, 4, 1), each padded to 4 rows of 3 fp32.
    assert padded_shard_nbytes(torch.Size([13, 3]), torch.float32, 4) == 4 * 3 * 4
    assert padded_shard_nbytes(torch.Size([3]), torch.bfloat16, 8) == 1 * 2


def test_free_and_alloc_storage_keep_the_tensor_object() -> None:
    base = torch.empty(6, 4)
    view = base[:5]
    free_storage(base)
    assert is_storage_freed(view) and view.untyped_storage().size() == 0
    alloc_storage(base, 6 * 4 * 4)
    view.fill_(2.0)  # the view sees the re-allocated storage
    assert base[:5].eq(2.0).all() and not is_storage_freed(base)
