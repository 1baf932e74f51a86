"""Device / backend choice and device-mesh construction.

cuda → nccl, anything else → cpu + gloo. The mesh is 1-D ``("dp_shard",)`` or 2-D
``("dp_replicate", "dp_shard")``; nothing downstream may assume one or the other.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate"


def device_type() -> str:
    """The accelerator this process should use: "cuda" when present, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str) -> str:
    """The process-group backend for a device type (nccl for cuda, gloo for cpu)."""
    return {"cuda": "nccl"}.get(device, "gloo")


@dataclass(frozen=True)
class MeshDegrees:
    """Resolved data-parallel degrees; ``replicate * shard == world``."""

    replicate: int
    shard: int

    @property
    def world(self) -> int:
        return self.replicate * self.shard


def resolve_degrees(world_size: int, dp_replicate: int = 1, dp_shard: int = -1) -> MeshDegrees:
    """Fill a ``-1`` degree from the world size and check the product.

    Raises ValueError naming both numbers when they do not multiply to the world size.
    """
    for name, val in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        if not isinstance(val, int) or isinstance(val, bool) or (val < 1 and val != -1):
            raise ValueError(f"{name}={val!r} must be a positive int or -1 (fill the world)")
    if dp_replicate == -1 and dp_shard == -1:
        raise ValueError("dp_replicate and dp_shard cannot both be -1; set at most one to -1")
    if dp_shard == -1:
        if world_size % dp_replicate:
            raise ValueError(
                f"dp_replicate={dp_replicate} does not divide world size {world_size}")
        dp_shard = world_size // dp_replicate
    elif dp_replicate == -1:
        if world_size % dp_shard:
            raise ValueError(f"dp_shard={dp_shard} does not divide world size {world_size}")
        dp_replicate = world_size // dp_shard
    if dp_replicate * dp_shard != world_size:
        raise ValueError(
            f"dp_replicate={dp_replicate} x dp_shard={dp_shard} = {dp_replicate * dp_shard} "
            f"does not equal the world size {world_size}")
    return MeshDegrees(dp_replicate, dp_shard)


def init_distributed(device: str | None = None, timeout_s: float | None = None) -> str:
    """Initialise the default process group from torchrun's environment if needed.

    Returns the device type in use. Without torchrun variables a 1-process group is made on a
    free local port, so single-process scripts and notebooks work too.
    """
    device = device or device_type()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        kwargs = {}
        if timeout_s is not None:
            from datetime import timedelta
            kwargs["timeout"] = timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend_for(device), **kwargs)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return device


def build_mesh(dp_replicate: int = 1, dp_shard: int = -1, device: str | None = None) -> DeviceMesh:
    """A 1-D ``dp_shard`` mesh, or a 2-D ``(dp_replicate, dp_shard)`` mesh when replicate > 1.

    The process group must already exist (see :func:`init_distributed`).
    """
    degrees = resolve_degrees(dist.get_world_size(), dp_replicate, dp_shard)
    device = device or device_type()
    if degrees.replicate == 1:
        return init_device_mesh(device, (degrees.shard,), mesh_dim_names=(SHARD_DIM,))
    return init_device_mesh(device, (degrees.replicate, degrees.shard),
                            mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


def init_mesh(dp_replicate: int = 1, dp_shard: int = -1, device: str | None = None) -> DeviceMesh:
    """Initialise the process group (if needed) and build the data-parallel mesh."""
    if dist.is_initialized():
        # Validate before any collective work so a bad degree fails fast and clearly.
        resolve_degrees(dist.get_world_size(), dp_replicate, dp_shard)
    device = init_distributed(device)
    return build_mesh(dp_replicate, dp_shard, device)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
