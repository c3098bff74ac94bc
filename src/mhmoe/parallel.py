"""Head parallelism: which heads a rank of a process group owns (docs/contract.md section 6).

The head count is padded up to a multiple of the world size with zero heads;
rank r owns the contiguous run of `local_heads` heads starting at
`r * local_heads`. A rank whose run starts past the real heads owns none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HeadPartition:
    """The heads of one rank. Example: 12 heads on 8 ranks pad to 16, so each
    rank owns 2; rank 5 owns heads 10 and 11, ranks 6 and 7 own only padding."""

    num_heads: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"HeadPartition: num_heads must be >= 1, got {self.num_heads}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"HeadPartition: rank {self.rank} is not in a world of "
                             f"{self.world_size}")

    @property
    def local_heads(self) -> int:
        """Heads per rank, padding included: ceil(num_heads / world_size)."""
        return -(-self.num_heads // self.world_size)

    @property
    def padded_heads(self) -> int:
        return self.local_heads * self.world_size

    @property
    def start(self) -> int:
        """Global index of this rank's first head."""
        return self.rank * self.local_heads

    @property
    def real_heads(self) -> int:
        """How many of this rank's heads are real (the rest are zero padding)."""
        return max(0, min(self.local_heads, self.num_heads - self.start))

    def rows(self, num_experts: int) -> tuple[int, int]:
        """The [begin, end) rows of a per-flat-expert tensor this rank owns.

        Rows at or past `num_heads * num_experts` are padding (zeros)."""
        begin = self.start * num_experts
        return begin, begin + self.local_heads * num_experts

    @classmethod
    def of_group(cls, num_heads: int, group: dist.ProcessGroup | None) -> HeadPartition:
        """The partition of the calling rank in `group` (a world of 1 if None)."""
        if group is None:
            return cls(num_heads)
        return cls(num_heads, dist.get_world_size(group), dist.get_rank(group))


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group)
        return grad_in, None, None, None


def dispatch(x: torch.Tensor, partition: HeadPartition, token_counts: Sequence[int],
             group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send every rank the heads it owns, for the tokens of all ranks.

    x: [S_r, H * D] this rank's tokens, all heads (S_r = token_counts[rank])
    returns [sum(token_counts), local_heads, D]: this rank's heads for every
    rank's tokens, in rank order; padding heads are zeros. One all-to-all.
    """
    world, Hl = partition.world_size, partition.local_heads
    S = x.shape[0]
    D = x.shape[1] // partition.num_heads
    heads = x.view(S, partition.num_heads, D)
    if partition.padded_heads > partition.num_heads:
        heads = torch.cat([heads, heads.new_zeros(S, partition.padded_heads - partition.num_heads,
                                                  D)], dim=1)
    # [S, world, Hl*D] -> [world, S, Hl*D]: the block for rank j is contiguous.
    send = heads.reshape(S, world, Hl * D).transpose(0, 1).reshape(world * S, Hl * D)
    recv = _AllToAll.apply(send, list(token_counts), [S] * world, group)
    return recv.view(-1, Hl, D)


def undispatch(y: torch.Tensor, partition: HeadPartition, token_counts: Sequence[int],
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """The inverse of `dispatch`: every rank gets all heads of its own tokens back.

    y: [sum(token_counts), local_heads, D] -> [S_r, H * D] (padding heads dropped).
    """
    world, Hl = partition.world_size, partition.local_heads
    D = y.shape[-1]
    S = token_counts[partition.rank]
    recv = _AllToAll.apply(y.reshape(-1, Hl * D), [S] * world, list(token_counts), group)
    full = recv.view(world, S, Hl * D).transpose(0, 1).reshape(S, partition.padded_heads, D)
    return full[:, :partition.num_heads].reshape(S, partition.num_heads * D)


def gather_token_counts(num_tokens: int, device: torch.device,
                        group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's token count: one all_gather and one host read (use only when
    the caller cannot pass the counts in)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [int(t) for t in torch.cat(everyone).tolist()]


def shard_state_dict(state: dict[str, torch.Tensor], partition: HeadPartition,
                     num_experts: int) -> dict[str, torch.Tensor]:
    """One rank's rows of a full (all-heads) layer state dict, zero-padded
    (docs/contract.md section 6).

    Every per-expert tensor has the flat expert id as dim 0; the rank takes
    rows `partition.rows(num_experts)`; rows past the end are zeros.
    """
    begin, end = partition.rows(num_experts)
    out = {}
    for name, tensor in state.items():
        part = tensor[begin:end]
        if part.shape[0] < end - begin:
            pad = tensor.new_zeros((end - begin - part.shape[0], *tensor.shape[1:]))
            part = torch.cat([part, pad])
        out[name] = part.clone()
    return out
