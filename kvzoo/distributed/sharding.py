"""Head-sharded caches: a CacheSpec split over a process group by KV heads.

Tensor parallelism gives each rank some KV heads and the query heads that read them. Attention
of one query head reads only its own KV head's codes and per-(token, head) scales, so the ranks
write and attend with no communication at all; only the outputs are gathered. Each rank's
cache is an ordinary cache of its heads (`HeadShard.spec`), run by the ordinary plan and API.

Byte equality with one process holding every head holds where each head's result does not
depend on how many heads are launched together. The NumPy and Numba implementations compute
each (sequence, head) alone. Triton's decode splits long contexts (from 2048 tokens) into a
number of pieces chosen from the grid's size, which counts KV heads: an unsharded run and a
sharded one can then split differently and differ by rounding. `batch_invariant=True` fixes
the split points to the sequence's own length, and sharded outputs are the unsharded bytes
again (tests/distributed_scenarios.py runs both).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..arrays import torch
from ..errors import fail
from ..layout import KVCacheTensors
from ..plan import CacheSpec, StepPlan, plan_step
from ..validate import int_scalar

__all__ = ["HeadShard", "shard_spec"]


@dataclass(frozen=True, eq=False)
class HeadShard:
    """One rank's part of a head-sharded cache; built by `shard_spec`.

    Attributes
    ----------
    full : kvzoo.CacheSpec
        The whole model's cache (every KV head).
    spec : kvzoo.CacheSpec
        This rank's cache: `full` with ``num_kv_heads = full.num_kv_heads // world_size``.
    num_q_heads : int
        The model's query heads.
    rank, world_size : int
        This rank's index in the group, and the group's size.
    group : torch.distributed.ProcessGroup or None
        The group `gather` runs over (None: the default group).
    """

    full: CacheSpec
    spec: CacheSpec
    num_q_heads: int
    rank: int
    world_size: int
    group: Any = None

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads, in the model's numbering."""
        n = self.spec.num_kv_heads
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def q_heads(self) -> range:
        """This rank's query heads: those reading its KV heads (GQA groups stay whole)."""
        n = self.local_q_heads
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def local_q_heads(self) -> int:
        return self.num_q_heads // self.world_size

    def local_kv(self, x: Any) -> Any:
        """This rank's KV heads of a whole-model key or value [T, num_kv_heads, D] (a view)."""
        return _heads(x, "x", self.full.num_kv_heads, self.kv_heads)

    def local_q(self, x: Any) -> Any:
        """This rank's query heads of a whole-model query [T, num_q_heads, D] or of sinks
        [num_q_heads] (a view)."""
        return _heads(x, "x", self.num_q_heads, self.q_heads)

    def allocate(self) -> KVCacheTensors:
        """A zero-filled cache of this rank's heads."""
        return self.spec.allocate()

    def plan_step(self, *, sinks: Any = None, **kwargs: Any) -> StepPlan:
        """`kvzoo.plan_step` for this rank's cache: its query heads, its part of the model's
        sinks ([num_q_heads] float32, if given); every other argument as plan_step takes it
        (the metadata is the same on every rank)."""
        if "num_q_heads" in kwargs or "cache_spec" in kwargs:
            fail("num_q_heads, cache_spec: a HeadShard passes its own; leave them out")
        local_sinks = None if sinks is None else self.local_q(sinks)
        return plan_step(self.spec, num_q_heads=self.local_q_heads, sinks=local_sinks, **kwargs)

    def gather(self, x: Any) -> Any:
        """Every rank's heads of an output, in head order: [T, local heads, ...] -> [T, local
        heads x world_size, ...] (attention's out [T, Hq/W, D] or lse [T, Hq/W]).

        A collective: every rank of the group calls it with the same shape and dtype. The bytes
        are moved, not computed, so the result is each rank's output bit for bit.
        """
        import torch.distributed as dist

        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            fail(f"x: expected a torch.Tensor [num_tokens, heads, ...], got {getattr(x, 'shape', type(x).__name__)}")
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=1)


def _heads(x: Any, name: str, count: int, heads: range) -> Any:
    axis = 0 if len(x.shape) == 1 else 1
    if len(x.shape) < 1 or int(x.shape[axis]) != count:
        fail(f"{name}: expected {count} heads on axis {axis}, got shape {tuple(x.shape)}")
    return x[heads.start : heads.stop] if axis == 0 else x[:, heads.start : heads.stop]


def shard_spec(
    spec: CacheSpec,
    num_q_heads: int,
    *,
    group: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> HeadShard:
    """Split a cache over a process group by KV heads.

    Rank r of W holds KV heads ``[r * Hkv/W, (r + 1) * Hkv/W)`` and query heads
    ``[r * Hq/W, (r + 1) * Hq/W)``, the ones that read them (query head h reads KV head
    ``h // (Hq/Hkv)``), as tensor-parallel attention splits its projections.

    Parameters
    ----------
    spec : kvzoo.CacheSpec
        The whole model's cache.
    num_q_heads : int
        The model's query heads (a multiple of ``spec.num_kv_heads``).
    group : torch.distributed.ProcessGroup, optional
        The ranks sharing the heads (default: the default group, which must be initialised
        when rank and world_size are not given).
    rank, world_size : int, optional
        This rank's index and the group's size, instead of asking torch.distributed (for
        building a rank's spec without a group; `HeadShard.gather` still needs one).

    Returns
    -------
    HeadShard

    Raises
    ------
    kvzoo.KVZooInputError
        The KV heads do not divide over the ranks (each rank needs at least one whole KV head;
        replicating heads over more ranks than there are heads is not done here).

    Examples
    --------
    >>> import kvzoo
    >>> from kvzoo.distributed import shard_spec
    >>> spec = kvzoo.CacheSpec("fp8_per_token_head", num_blocks=64, block_size=16, num_kv_heads=8,
    ...                        head_size=128)
    >>> shard = shard_spec(spec, num_q_heads=32, rank=1, world_size=4)
    >>> shard.spec.num_kv_heads, shard.kv_heads, shard.q_heads
    (2, range(2, 4), range(8, 16))
    """
    if not isinstance(spec, CacheSpec):
        fail(f"spec: expected a kvzoo.CacheSpec, got {type(spec).__name__}")
    num_q_heads = int_scalar("num_q_heads", num_q_heads, 1)
    if num_q_heads % spec.num_kv_heads:
        fail(f"num_q_heads: {num_q_heads} must be a multiple of the cache's num_kv_heads {spec.num_kv_heads}")
    if (rank is None) != (world_size is None):
        fail("rank, world_size: give both, or neither (then the group says)")
    if rank is None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            fail("group: torch.distributed is not initialised; call init_process_group, or pass rank and world_size")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            fail("group: this process is not a member of the group")
    world_size = int_scalar("world_size", world_size, 1)
    rank = int_scalar("rank", rank, 0, world_size - 1, "world_size - 1")
    if spec.num_kv_heads % world_size:
        fail(
            f"world_size: the cache's {spec.num_kv_heads} KV heads do not split evenly over {world_size} ranks "
            f"(each rank takes whole KV heads with their {num_q_heads // spec.num_kv_heads} query heads)"
        )
    local = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // world_size)
    return HeadShard(spec, local, num_q_heads, rank, world_size, group)
