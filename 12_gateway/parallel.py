"""The parallel layers: each rank holds a slice of every weight matrix and computes its part of the layer.

A linear layer ``y = x @ W^T`` (W: [out, in]) can be split across N ranks two ways (Megatron-LM's):

    column-parallel: rank r holds rows [r*out/N, (r+1)*out/N) of W (output features)
        y_r = x @ W_r^T              each rank gets its own slice of y; no communication
    row-parallel:    rank r holds columns [r*in/N, (r+1)*in/N) of W (input features)
        y   = sum_r x_r @ W_r^T      each rank's x_r is its slice of x; an all-reduce sums the parts

The trick is to pair them: a column-parallel layer's output slice is exactly the input slice the next,
row-parallel layer needs, so the pair costs one all-reduce (``column_row_pair``). A decoder layer has two pairs:

    attention: q/k/v projections column-parallel (each rank its heads), attention per head, o_proj row-parallel
    MLP:       gate/up column-parallel (each rank its features), SwiGLU per feature, down_proj row-parallel

Everything else (the norms, the residual stream, RoPE) is tiny and replicated: every rank holds the whole
hidden state after each all-reduce. The embedding and the output projection are split by vocabulary: each
rank looks up only its own slice of the tokens, and the output projection is a column-parallel layer whose
rows are token ids: each rank scores its slice, and rank 0 gathers the slices into whole rows of logits.

Each layer here knows which slice of the checkpoint's tensor it holds (``shards``), so that every rank
reads only its own slices from the safetensors files, and N ranks each hold about 1/N of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .distributed import TPGroup
from .matmul import linear
from .quantize import embedding


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor a rank holds: indices [start, stop) along dimension ``dim``."""

    dim: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def index(self) -> tuple[slice, ...]:
        """What to slice the full tensor with: ``full[shard.index()]`` is this rank's part."""
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


def even_shard(size: int, tp: TPGroup, dim: int = 0) -> Shard:
    """Rank r's 1/N of ``size`` rows (or columns, along ``dim``). ``size`` must divide by N."""
    assert size % tp.size == 0, f"{size} does not divide by {tp.size} ranks"
    part = size // tp.size
    return Shard(dim, tp.rank * part, (tp.rank + 1) * part)


def head_shards(num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup) -> tuple[Shard, Shard]:
    """The rows of q_proj and of k_proj / v_proj that rank r holds: its query heads, and the KV heads they use.

    Query heads split evenly. KV heads split evenly too while there are at least N of them; with fewer
    (N a multiple of num_kv_heads), each KV head is *replicated* on N / num_kv_heads ranks, and a rank
    holds the one its query heads read: query head h reads KV head h // (num_heads / num_kv_heads)."""
    ### BEGIN SOLUTION 9.1
    heads = num_heads // tp.size  # query heads per rank
    q = Shard(0, tp.rank * heads * head_dim, (tp.rank + 1) * heads * head_dim)
    if num_kv_heads >= tp.size:
        kv_heads = num_kv_heads // tp.size
        kv = Shard(0, tp.rank * kv_heads * head_dim, (tp.rank + 1) * kv_heads * head_dim)
    else:  # the KV head of this rank's first query head (all of its query heads share it)
        kv_head = tp.rank * heads // (num_heads // num_kv_heads)
        kv = Shard(0, kv_head * head_dim, (kv_head + 1) * head_dim)
    return q, kv
    ### END SOLUTION


class ColumnParallelLinear(nn.Module):
    """``y_r = x @ W_r^T + b_r``: rank r computes the output features ``rows`` of the full layer.

    Its input is the whole (replicated) ``x``; its output is this rank's slice, to be consumed by a
    row-parallel layer or by something that works feature by feature (attention heads, SwiGLU).

    A stacked layer (q/k/v, gate/up) is several checkpoint matrices in one: ``rows`` has this rank's rows
    of each, in order, and W_r stacks them: [q_r; k_r; v_r], so the rank's output is its q, then its k and v."""

    def __init__(self, in_features: int, rows: list[Shard], bias: bool) -> None:
        super().__init__()
        assert all(shard.dim == 0 for shard in rows)
        size = sum(shard.size for shard in rows)
        self.weight = nn.Parameter(torch.empty(size, in_features))  # W_r: [out / N, in]
        self.bias = nn.Parameter(torch.empty(size)) if bias else None
        self.shards = {"weight": rows, "bias": rows}  # per parameter: one slice per stacked checkpoint tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out / N]
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r @ W_r^T + b``: rank r holds the input features ``columns`` of W and gets the matching
    slice ``x_r`` of the input (a column-parallel layer's output). Each rank's product is a partial sum of
    every output; the all-reduce adds them up, so every rank ends with the whole ``y``."""

    def __init__(self, columns: Shard, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        assert columns.dim == 1
        self.weight = nn.Parameter(torch.empty(out_features, columns.size))  # W_r: [out, in / N]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # the whole bias, on every rank
        self.shards = {"weight": [columns]}
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / N] (this rank's slice) -> [T, out] (the sum over ranks)
        ### BEGIN SOLUTION 9.2
        # The bias goes into rank 0's part only: the all-reduce adds it once, not N times.
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(linear(x, self.weight, bias))
        ### END SOLUTION


def column_row_pair(hidden_size: int, rows: list[Shard], bias: tuple[bool, bool],
                    tp: TPGroup) -> tuple[nn.Module, nn.Module]:
    """This rank's part of the two linear layers around a computation that works feature by feature (attention head
    by head, SwiGLU feature by feature), split so that the pair costs one all-reduce: ``(first, second)``.

    The first reads the hidden state and may stack several checkpoint matrices (q, k, v; gate, up): ``rows`` holds
    this rank's rows of each, in order. The computation in between turns them into features shaped like the first
    matrix's (attention's output has q's heads, SwiGLU's has gate's features); the second turns those back into the
    hidden state, which every rank holds whole. ``bias``: whether the first and the second have one."""
    ### BEGIN SOLUTION 9.5
    # Column-parallel first: from the whole hidden state, this rank's rows of each stacked matrix, no communication.
    first = ColumnParallelLinear(hidden_size, rows, bias=bias[0])
    # Row-parallel second: its input features are the ones this rank computed in between, the first matrix's rows;
    # its partial sums go through the pair's one all-reduce.
    columns = Shard(1, rows[0].start, rows[0].stop)
    return first, RowParallelLinear(columns, hidden_size, bias=bias[1], tp=tp)
    ### END SOLUTION


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the embedding rows of token ids [start, stop): a 1/N slice of the vocabulary.

    Each token id belongs to exactly one rank. Every rank looks up every token, but only the ones in its
    slice find a row; the others get zeros, and the all-reduce (a sum) leaves each token with its one row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.rows = even_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.rows.size, hidden_size))  # [V / N, hidden]
        self.shards = {"weight": [self.rows]}
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        ### BEGIN SOLUTION 9.3
        mine = (input_ids >= self.rows.start) & (input_ids < self.rows.stop)  # [T] bool
        local = (input_ids - self.rows.start) * mine  # another rank's token looks up row 0 here, masked just below
        x = embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)  # [T, hidden]
        return self.tp.all_reduce(x)
        ### END SOLUTION
