"""Head parallelism: which heads a rank of a process group owns (SPEC section 6).

The head count is padded up to a multiple of the world size with zero heads;
rank r owns the contiguous run of `local_heads` heads starting at
`r * local_heads`. A rank whose run starts past the real heads owns none.
"""

from __future__ import annotations

from dataclasses import dataclass

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
