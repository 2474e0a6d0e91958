"""The KV cache as a pool of blocks, allocated once at start-up from a memory budget.

Stage 02 let Hugging Face grow one contiguous cache per request. Here the server reserves all
the cache memory it will ever use up front and cuts it into blocks of ``block_size`` tokens:
for every layer, K and V each get ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Which block belongs to which sequence is the ``BlockManager``'s business, not this tensor's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    """What sizes a block: the model's attention geometry and the tokens per block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: what one cached token costs."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token


def budget_bytes(device: torch.device, kv_cache_mb: int, gpu_memory_utilization: float) -> int:
    """How much memory the pool may take: ``--kv-cache-mb`` on CPU; on CUDA a share of what is free.

    On CUDA the weights are already loaded when this runs, so "free" is what is left for the cache
    (and for activations, which is why the share is below 1).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * gpu_memory_utilization)
    return kv_cache_mb * 2**20


@dataclass
class KVCache:
    """K and V pools for every layer in one tensor: ``[2, num_layers, num_blocks, block_size, Hkv, D]``."""

    shape: CacheShape
    num_blocks: int
    data: torch.Tensor

    @classmethod
    def allocate(cls, shape: CacheShape, budget: int, device: torch.device) -> KVCache:
        num_blocks = budget // shape.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"a KV-cache budget of {budget} bytes is less than one block "
                             f"({shape.bytes_per_block} bytes of {shape.block_size} tokens)")
        data = torch.zeros(2, shape.num_layers, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
                           dtype=shape.dtype, device=device)
        return cls(shape, num_blocks, data)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K pool and the V pool of one layer, each ``[num_blocks, block_size, Hkv, D]`` (views)."""
        return self.data[0, index], self.data[1, index]

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()
