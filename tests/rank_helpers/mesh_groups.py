"""Torch's own answer for the rank grid: the members of every group of a 4-D ``DeviceMesh``.

``init_device_mesh("cpu", shape, mesh_dim_names=DIMS)`` lays the world out the way torch does and makes a
process group per dimension; this returns, for each dimension, the ranks of this rank's group in it. Run on
cold ranks (``warm=False``): a mesh's groups cannot be handed back, and must not stay on a warm rank.
"""
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from workers.layout.grid import DIMS


def main(ctx, shape: str = "2,2,1,2"):
    sizes = tuple(int(s) for s in shape.split(","))
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=DIMS)
    return {"groups": {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in DIMS if mesh[d].size() > 1}}
