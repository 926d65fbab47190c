"""Tensor parallelism by hand: column- and row-parallel linear layers (Megatron's f and g
operators as autograd functions), built from a dense layer so they can be checked against it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError


class _CopyToParallel(torch.autograd.Function):
    """Forward: identity (the input is replicated). Backward: sum the gradient over ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Forward: sum partial results over ranks. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _GatherFromParallel(torch.autograd.Function):
    """Forward: concatenate every rank's slice on the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()].contiguous()


def _split(n: int, what: str) -> int:
    world = dist.get_world_size()
    if n % world:
        raise ConfigError(f"{what} ({n}) must divide evenly over {world} ranks; pick a multiple of {world}.")
    return n // world


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T + b with W split by output rows: each rank computes a slice of the outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False) -> None:
        super().__init__()
        self.local_out = _split(out_features, "out_features")
        self.gather_output = gather_output
        self.weight = torch.nn.Parameter(torch.empty(self.local_out, in_features))
        self.bias = torch.nn.Parameter(torch.zeros(self.local_out)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_dense(cls, dense: torch.nn.Linear, gather_output: bool = False) -> ColumnParallelLinear:
        layer = cls(dense.in_features, dense.out_features, dense.bias is not None, gather_output)
        rows = slice(dist.get_rank() * layer.local_out, (dist.get_rank() + 1) * layer.local_out)
        with torch.no_grad():
            layer.weight.copy_(dense.weight[rows])
            if layer.bias is not None and dense.bias is not None:
                layer.bias.copy_(dense.bias[rows])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(_CopyToParallel.apply(x), self.weight, self.bias)
        return _GatherFromParallel.apply(y) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """y = x W^T + b with W split by input columns: each rank holds a slice of the input and
    a partial sum of the output; one all-reduce completes it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.local_in = _split(in_features, "in_features")
        self.weight = torch.nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_dense(cls, dense: torch.nn.Linear) -> RowParallelLinear:
        layer = cls(dense.in_features, dense.out_features, dense.bias is not None)
        cols = slice(dist.get_rank() * layer.local_in, (dist.get_rank() + 1) * layer.local_in)
        with torch.no_grad():
            layer.weight.copy_(dense.weight[:, cols])
            if layer.bias is not None and dense.bias is not None:
                layer.bias.copy_(dense.bias)
        return layer

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.linear(x_local, self.weight)
        y = _ReduceFromParallel.apply(partial)
        return y + self.bias if self.bias is not None else y
