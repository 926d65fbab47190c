"""torch's private names nbdist relies on (process groups, DDP's logger and timers, FSDP2's collectives)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def group_sequence_number(group: Any) -> int:
    """How many collectives this process group has issued (its sequence number), C++ callers included."""
    return int(group._get_sequence_number_for_group())


def abort_process_group() -> None:
    """Abort the default process group (NCCL): collectives blocked on it return with an error."""
    import torch.distributed as dist

    dist.distributed_c10d._abort_process_group()


def ddp_time_every_step(model: Any) -> Any:
    """Have DDP's reducer time every step's gradient reduction; return DDP's C++ logger."""
    model._set_ddp_runtime_logging_sample_rate(1)
    return model.logger


def ddp_timers(logger: Any) -> dict[str, int]:
    """DDP's timers for the last step (nanoseconds): backward_comm_time, *_start, *_end, ..."""
    logger.set_runtime_stats_and_log()  # what DDP's next forward would do; idempotent
    return dict(logger._get_ddp_logging_data().ints_map)


def fsdp_collective_classes() -> tuple[type, type]:
    """FSDP2's default all-gather and reduce-scatter callables (subclassed to time them)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    return DefaultAllGather, DefaultReduceScatter


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """On this rank, a default process group of one rank (gloo, an in-memory store) while the block runs; the
    world's own group, untouched, is the default again after it. ``dist.get_world_size()``, DDP, FSDP and
    ``DistributedSampler`` see a world of one inside (nbdist's %dist_equiv runs a cell there)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world.default_pg
    c10d._world.default_pg = None  # init_process_group refuses to make a second default group
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except BaseException:
        c10d._world.default_pg = world
        raise
    one = c10d._world.default_pg
    try:
        yield
    finally:
        c10d._world.default_pg = world
        dist.destroy_process_group(one)  # no longer the default: only its own entries go
        # torch frees a gloo group by joining its worker threads, holding the GIL; a worker still freeing the
        # block's last collective needs the GIL for it (its captured thread-local state holds a Python object):
        # freed with the block's DDP model, the group hung the process (stop 77's CI: the main thread in
        # ~ProcessGroupGloo joining pt_gloo_runloop, which waited for the GIL in ~AsyncWork). Kept until the next
        # block, when its workers are long idle.
        _LAST_ONE[:] = [one]


_LAST_ONE: list[Any] = []  # the last world_of_one's group, freed by the next one


def fsdp_waits() -> list[tuple[Any, str]]:
    """FSDP2's methods in which a rank waits for its collectives on the main thread: the all-gather (issued, and on
    CPU run, by ``unshard``), its wait and copy-out before a module's forward or backward, the post-backward that
    issues (on CPU: runs) the reduce-scatter, and the end of backward that waits for what is left. (class, method
    name) pairs; none where FSDP2 is missing."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return []
    names = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")
    return [(FSDPParamGroup, name) for name in names]


def mem_tracker() -> Any:
    """torch's MemTracker, which also follows a module called more than once per step at the top level (a pipeline
    stage runs once per micro-batch). MemTracker refuses that as "the next iteration" in its private pre-forward
    hook; forgetting the module's own stats there lets it count on. Its peak, which nbdist reads, is global."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _MicrobatchTracker(MemTracker):  # type: ignore[misc]
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return _MicrobatchTracker()


def ddp_on_a_fake_group(model: Any, **kwargs: Any) -> Any:
    """DistributedDataParallel over a fake process group and fake tensors, holding the memory the real one holds.

    Three of DDP's private steps read what a fake group's collectives carry, which is nothing: the constructor
    compares parameter shapes across ranks, the first forward rebuilds the buckets in an order the ranks broadcast,
    and the all-reduce's future holds no tensor. The check is skipped, the rebuild kept off (the buckets keep their
    sizes), and each bucket reduced in place, as the built-in hook does."""
    import torch
    import torch.nn.parallel.distributed as ddp_module

    verify = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *a, **k: None
    try:
        ddp = ddp_module.DistributedDataParallel(model, **kwargs)
    finally:
        ddp_module._verify_param_shape_across_processes = verify

    def in_place(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads a hook's annotations: give none
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, in_place)

    class KeptBuckets:
        def __init__(self, reducer: Any) -> None:
            self._reducer = reducer

        def _rebuild_buckets(self) -> bool:
            return False

        def __getattr__(self, name: str) -> Any:
            return getattr(self._reducer, name)

    ddp.reducer = KeptBuckets(ddp.reducer)  # type: ignore[assignment]
    return ddp


def real_tensors() -> Any:
    """A context in which tensors are real again inside FakeTensorMode (torch's ``unset_fake_temporarily``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def ddp_bucket_bytes(ddp: Any) -> int:
    """The bytes of DDP's gradient buckets: a second copy of the gradients that the reducer allocates when it is built
    (and again when it rebuilds them in the second step), before any step a tracker watches."""
    return sum(b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets())


def cuda_bad_fork(torch: Any) -> None:
    """In a process just forked: torch takes it for a fork that cannot use CUDA, as it does for a child of a process
    that initialised CUDA itself, so touching CUDA raises its 'Cannot re-initialize CUDA in forked subprocess. To use
    CUDA with multiprocessing, you must use the 'spawn' start method' (torch.cuda._lazy_init asks
    torch.cuda._is_in_bad_fork first)."""
    torch.cuda._is_in_bad_fork = lambda: True


@contextlib.contextmanager
def outside_trackers(module: Any, tensors: dict[str, Any]) -> Iterator[None]:
    """``module`` run as plain torch runs it: no dispatch mode (fake tensors, MemTracker, a timer), no global module
    hook (MemTracker's module tracker), and ``tensors`` (qualified name -> real tensor) in place of its parameters and
    buffers."""
    import torch.nn.modules.module as mm
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils._python_dispatch import _disable_current_modes

    names = [k for k in dir(mm) if k.startswith("_global_") and k.endswith("_hooks")]
    saved = {k: getattr(mm, k) for k in names}
    try:
        for k, hooks in saved.items():
            setattr(mm, k, type(hooks)())
        with _disable_current_modes(), _reparametrize_module(module, tensors):
            yield
    finally:
        for k, hooks in saved.items():
            setattr(mm, k, hooks)


@contextlib.contextmanager
def meshes_made_for_real() -> Iterator[None]:
    """FSDP2 over tensor-parallel parameters joins the two meshes (``DeviceMesh._concatenate``, once per parameter);
    the new mesh finds this rank's coordinates with ``nonzero`` on its rank map, which fake tensors cannot answer
    (its output's shape depends on the values). Here that map is real, and so is the search: a few integers."""
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def real(meshes: Any) -> Any:
        with real_tensors():
            return concatenate(meshes)

    DeviceMesh._concatenate = staticmethod(real)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign,assignment]


def group_size_of(arg: Any) -> int | None:
    """The ranks of the group an operator's argument names: a ProcessGroup as the dispatcher passes it (c10d's
    operators) or a group's name (the functional collectives DTensor calls); None for any other argument."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        if isinstance(arg, torch.ScriptObject):
            return int(dist.ProcessGroup.unbox(arg).size())
        if isinstance(arg, str):
            return int(_resolve_process_group(arg).size())  # type: ignore[arg-type]  # a group's name, as given
    except (ValueError, RuntimeError, KeyError):
        pass
    return None
