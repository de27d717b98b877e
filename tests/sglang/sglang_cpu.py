"""Shared set-up for building SGLang's own model classes on CPU in a test process (0.5.17 and 0.5.22):
publish resolved server args the way SGLang's processes do, and a world-1 gloo group with SGLang's
model-parallel state (as SGLang's layer unit tests do). Import only where SGLang is installed."""

from __future__ import annotations

import inspect
import socket
from contextlib import contextmanager

import torch


def publish_args(server_args, world_rank: int = 0) -> None:
    """Publish `server_args` for this process (0.5.22 also wants this process's ranks)."""
    from sglang.srt.runtime_context import publish

    if "ranks" in inspect.signature(publish).parameters:  # 0.5.22
        from sglang.srt.runtime_context import SpawnRanks

        publish(server_args, role="test", ranks=SpawnRanks(world_rank=world_rank))
    else:
        publish(server_args, role="test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tp_groups(rank: int, world_size: int, port: int) -> None:
    """This process as rank `rank` of a `world_size`-process gloo world, all of it one TP group
    (publish the server args, with --tp-size world_size, first)."""
    from sglang.srt.distributed import parallel_state as ps

    cuda_group = ps.init_model_parallel_group

    def cpu_group(*args, **kwargs):  # no NCCL / custom all-reduce communicators: gloo alone
        return cuda_group(*args, **{**kwargs, "use_pynccl": False, "use_custom_allreduce": False,
                                    "use_torch_symm_mem_allreduce": False})

    ps.init_model_parallel_group = cpu_group
    ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:  # 0.5.17
        ps.initialize_model_parallel(tensor_model_parallel_size=world_size, backend="gloo")
    else:  # 0.5.22 reads the widths from the published args
        ps.initialize_model_parallel(backend="gloo")


@contextmanager
def single_process_groups():
    """A world-1 gloo process group and SGLang's model-parallel state for the duration; torn down
    after only if this call created them (another module's fixture may own them)."""
    from sglang.srt.distributed import parallel_state as ps

    started = not torch.distributed.is_initialized()
    if started:
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    if not ps.model_parallel_is_initialized():
        if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:  # 0.5.17
            ps.initialize_model_parallel(tensor_model_parallel_size=1, backend="gloo")
        else:  # 0.5.22 reads the widths from the published args
            ps.initialize_model_parallel(backend="gloo")
    try:
        yield
    finally:
        if started:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
