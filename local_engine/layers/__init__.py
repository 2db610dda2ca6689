"""local_engine/layers: attention over the paged cache, norms, rotary tables, the `Ops` seam and its torch backend."""

from local_engine.layers.attention import Attention, AttentionMetadata
from local_engine.layers.backend import Ops, select_ops
from local_engine.layers.norm import RMSNorm
from local_engine.layers.rotary import build_cos_sin_cache

__all__ = ["Attention", "AttentionMetadata", "Ops", "RMSNorm", "build_cos_sin_cache", "select_ops"]
