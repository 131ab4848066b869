"""ZeRO by hand (chapter 11): ``Zero1Optimizer`` shards any torch optimizer's state over data-parallel ranks."""
from workers.zero.zero1 import Zero1Optimizer, flat_partition, params_partition

__all__ = ["Zero1Optimizer", "flat_partition", "params_partition"]
