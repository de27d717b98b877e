"""Data parallelism for `dspine train`: one process per device under torchrun, each with its own batches.

    torchrun --nproc-per-node N -m dspine.cli train CONFIG --data D --run-dir R

starts N trainers; `setup` reads torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK), joins the
process group (NCCL on CUDA, gloo on CPU) and gives each rank its GPU. Without torchrun the world
is one process and every collective here is a no-op.

Invariants:
* Data: rank r draws from records[r::world] of the shuffled training records (disjoint shards), in
  epochs, each a permutation seeded by (seed, rank, epoch); a step takes batch_size sequences per
  micro-batch, grad_accum_steps micro-batches, so after s steps rank r stands at sequence
  s · batch_size · grad_accum_steps of its stream. Batches and anchors are pure functions of
  (seed, rank, world, position): a resumed run (same world size) continues every rank where it
  stopped. The global batch is batch_size × world × grad_accum_steps sequences. With length
  grouping, each run of `group` positions of an epoch's permutation is sorted by sequence length
  (the same records, so an epoch still takes each once), so a batch pads less.
* Loss: each term is normalised by counts summed over the step's micro-batches and ranks
  (`dspine.train.losses.step_norms`), and each rank's backward is scaled by the world size,
  which cancels DDP's gradient averaging: the gradient is that of the global batch as one batch.
* Rank 0 alone logs, evaluates, saves and exports; the others wait at barriers.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import Tensor, nn

from dspine import env


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job: rank in [0, world), local_rank its device index on the host."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: Tensor) -> Tensor:
        """`t` summed over ranks (in place; `t` itself when the world is one process)."""
        if self.world > 1:
            tdist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier()

    def any(self, flag: bool, device) -> bool:
        """True on every rank when `flag` is True on some rank (a collective decision, e.g. a time limit)."""
        if self.world == 1:
            return flag
        return bool(self.all_sum(torch.tensor([float(flag)], device=device)).item() > 0)


_context = DistContext()


def setup(device: str) -> tuple[DistContext, str]:
    """`(context, device)`: under torchrun, the process group joined once (later calls return the
    same) and, for `device == "cuda"`, this rank's GPU made current; else one process and `device`."""
    global _context
    world = env.WORLD_SIZE.get()
    if world == 1:
        return _context, device
    if not tdist.is_initialized():
        cuda = torch.device(device).type == "cuda"
        local_rank = env.LOCAL_RANK.get()
        if cuda:
            torch.cuda.set_device(local_rank)
        tdist.init_process_group("nccl" if cuda else "gloo")
        _context = DistContext(rank=tdist.get_rank(), world=tdist.get_world_size(), local_rank=local_rank)
    if device == "cuda":
        device = f"cuda:{_context.local_rank}"
    return _context, device


def teardown() -> None:
    """Leaves the process group `setup` joined (a no-op without one). Called before the process
    exits: gloo's threads outliving the group at interpreter exit can abort the process."""
    global _context
    if tdist.is_initialized():
        tdist.destroy_process_group()
    _context = DistContext()


def context() -> DistContext:
    """The context of `setup` (one process when it was not called under torchrun)."""
    return _context


def wrap(objective: nn.Module, ctx: DistContext) -> nn.Module:
    """`objective` under DistributedDataParallel when the world is larger than one process (rank
    0's parameters are broadcast at construction), else itself."""
    if ctx.world == 1:
        return objective
    from torch.nn.parallel import DistributedDataParallel

    device = next(objective.parameters()).device
    return DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)


def no_sync(objective: nn.Module, last: bool):
    """Within it, a backward accumulates gradients without DDP's all-reduce, except for `last`
    (the step's final micro-batch); a plain context otherwise."""
    if last or not hasattr(objective, "no_sync"):
        return contextlib.nullcontext()
    return objective.no_sync()


def unwrap(objective: nn.Module) -> nn.Module:
    return getattr(objective, "module", objective)


class SequenceSampler:
    """Rank `rank`'s stream of training records (module docstring): `take(start, count)` gives the
    records at positions start..start+count-1 of the stream, `generator(start)` the anchor RNG of
    the batch that starts there. `group` > 1 sorts each run of that many positions by length."""

    def __init__(self, records: list[dict], *, seed: int, rank: int, world: int, group: int = 1):
        self.shard = records[rank::world]
        if not self.shard:
            raise ValueError(f"rank {rank} of {world} has no training records: use fewer processes or more data")
        self.seed, self.rank, self.group = seed, rank, group
        self._epochs: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            order = list(range(len(self.shard)))
            random.Random(f"{self.seed}:{self.rank}:{epoch}").shuffle(order)
            if self.group > 1:
                for i in range(0, len(order), self.group):
                    order[i:i + self.group] = sorted(order[i:i + self.group], key=lambda j: len(self.shard[j]["ids"]))
            self._epochs = {epoch: order}  # positions only move forward: keep the current epoch
        return self._epochs[epoch]

    def take(self, start: int, count: int) -> list[dict]:
        n = len(self.shard)
        return [self.shard[self._order(pos // n)[pos % n]] for pos in range(start, start + count)]

    def generator(self, start: int) -> torch.Generator:
        return torch.Generator().manual_seed(hash((self.seed, self.rank, start)) & (2**63 - 1))
