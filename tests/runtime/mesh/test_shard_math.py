"""Chunk arithmetic: our padding must agree with torch.chunk, which is what Shard(0) means."""

import pytest
import torch

from dtensor_fsdp.runtime.shard_geometry import ShardGeometry, chunk_rows, local_rows
from dtensor_fsdp.runtime.storage import alloc_storage, free_storage, is_storage_freed


@pytest.mark.parametrize("dim0", [1, 2, 3, 5, 7, 8, 13, 64, 1000])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 1024])
def test_local_rows_match_torch_chunk(dim0: int, world_size: int) -> None:
    chunks = torch.arange(dim0).chunk(world_size)
    expected = [len(c) for c in chunks] + [0] * (world_size - len(chunks))
    assert [local_rows(dim0, world_size, r) for r in range(world_size)] == expected
    assert sum(expected) == dim0
    assert chunk_rows(dim0, world_size) == max(expected)


def test_dim0_geometry_pads_to_full_chunks() -> None:
    # 13 rows over 4 ranks: chunks of 4 rows (4, 4, 4, 1), each padded to 4 rows.
    last = ShardGeometry(torch.Size([13, 3]), 0, 4, 3)
    assert last.padded_local_shape == (4, 3) and last.local_shape == (1, 3)
    assert last.padded_unsharded_shape == (16, 3) and last.padded_shard_numel == 12
    tensor = torch.arange(39).view(13, 3)
    torch.testing.assert_close(last.local_chunk(tensor), tensor.chunk(4)[3])
    assert ShardGeometry(torch.Size([3]), 0, 8, 5).local_shape == (0,)


def test_other_dim_geometry_is_an_even_split() -> None:
    geometry = ShardGeometry(torch.Size([3, 8, 2]), 1, 4, 2)
    assert geometry.padded_local_shape == geometry.local_shape == (3, 2, 2)
    assert geometry.padded_unsharded_shape == (3, 8, 2)
    tensor = torch.arange(48).view(3, 8, 2)
    torch.testing.assert_close(geometry.local_chunk(tensor), tensor.chunk(4, dim=1)[2])


def test_free_and_alloc_storage_keep_the_tensor_object() -> None:
    base = torch.empty(6, 4)
    view = base[:5]
    free_storage(base)
    assert is_storage_freed(view) and view.untyped_storage().size() == 0
    alloc_storage(base, 6 * 4 * 4)
    view.fill_(2.0)  # the view sees the re-allocated storage
    assert base[:5].eq(2.0).all() and not is_storage_freed(base)
