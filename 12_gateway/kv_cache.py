"""The KV cache as a pool of blocks, allocated once at start-up from a memory budget.

The server reserves all the cache memory it will ever use up front, not request by request, and
cuts it into blocks of ``block_size`` tokens:
for every layer, K and V each get ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Which block belongs to which sequence is the ``BlockManager``'s business, not this tensor's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, dtype: torch.dtype) -> int:
    """Bytes that the keys and values of ``num_tokens`` tokens take in the cache: in every layer, one
    key and one value vector of ``head_dim`` numbers per KV head, each number of ``dtype``."""
    ### BEGIN SOLUTION 3.4
    bytes_per_number = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_number * num_tokens
    ### END SOLUTION


def requests_that_fit(memory_bytes: int, bytes_per_request: int) -> int:
    """How many requests of ``bytes_per_request`` of cache each fit in ``memory_bytes``: whole ones only."""
    return memory_bytes // bytes_per_request


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
        return kv_cache_bytes(self.num_layers, self.num_kv_heads, self.head_dim, 1, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """What the pool is counted in: ``budget // bytes_per_block`` blocks."""
        return kv_cache_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)


CPU_DEFAULT_MB = 512  # the pool on a CPU when --kv-cache-mb is 0 (auto)


def budget_bytes(device: torch.device, kv_cache_mb: int, gpu_memory_utilization: float, freed_bytes: int = 0) -> int:
    """How much memory the pool may take: ``kv_cache_mb`` when it is set (any device); else on a CPU 512 MiB
    and the ``freed_bytes`` quantized weights no longer take, and on CUDA nano-vllm's rule (which finds those
    bytes free by itself).

    On CUDA: the share ``gpu_memory_utilization`` of the whole card, less what is in use now (the
    weights, other processes), less how far activations rose above that in the steps run so far
    (an engine that runs its largest step once, just before, counts its activations). The share below 1 leaves
    room for what comes later: CUDA graphs, NCCL buffers.
    """
    if kv_cache_mb > 0:
        return kv_cache_mb * 2**20
    if device.type == "cuda":
        torch.cuda.empty_cache()  # memory PyTorch holds but does not use is not "in use"
        free, total = torch.cuda.mem_get_info(device)
        activations = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        return int(total * gpu_memory_utilization - (total - free) - activations)
    return CPU_DEFAULT_MB * 2**20 + freed_bytes


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
