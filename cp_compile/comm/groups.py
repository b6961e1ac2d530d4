"""Process groups as the ops name them (a string a graph can hold) and as users pass them (a group, a 1-D or a 2-D
DeviceMesh, or None for the default group)."""

from __future__ import annotations

import torch.distributed as dist

from ..torch_compat import assume_constant_result, resolve_process_group


def resolve_group(group_name: str) -> dist.ProcessGroup:
    return resolve_process_group(group_name)


def is_2d_mesh(group) -> bool:
    """A 2-D (ring, a2a) DeviceMesh: eagerly only the hybrid schedule runs on one."""
    return hasattr(group, "get_group") and group.ndim == 2


@assume_constant_result
def _default_group_name() -> str:
    # Dynamo cannot read a ProcessGroup's name while tracing (an eager function called with group=None inside
    # torch.compile); the default group's name is fixed for the process and the same on every rank
    return dist.group.WORLD.group_name


def group_name_of(group) -> str:
    """Name of a ProcessGroup, a 1-D DeviceMesh, a group name, or None (the default group)."""
    if isinstance(group, str):
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group it was given: "
            "dist.new_group returns a placeholder to the ranks it leaves out; build the plan, and run CP "
            "attention, only on the group's members"
        )
    if group is None:
        return _default_group_name()
    if hasattr(group, "get_group"):  # DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"ring attention needs a 1-D DeviceMesh, got {group.ndim}-D")
        group = group.get_group()
    return group.group_name


def mesh_groups(mesh) -> tuple[str, str, str]:
    """(flattened group, ring group, all-to-all group) names of a 2-D ``(ring, a2a)`` DeviceMesh."""
    if mesh.ndim != 2:
        raise ValueError(f"the hybrid schedule needs a 2-D DeviceMesh (ring, a2a), got {mesh.ndim}-D")
    names = mesh.mesh_dim_names
    if names is not None and (names[0] in ("a2a", "ulysses") or names[1] == "ring"):
        raise ValueError(
            f"mesh_dim_names={names}: dim 0 must be the ring and dim 1 the all-to-all group "
            "(the all-to-all runs within groups of consecutive ranks); build the mesh as (ring, a2a)"
        )
    return (mesh._flatten().get_group().group_name, mesh.get_group(0).group_name, mesh.get_group(1).group_name)
