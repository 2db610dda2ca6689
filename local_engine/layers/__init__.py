"""local_engine/layers: attention over the paged cache, norms, rotary tables, and the torch ops backend."""

from local_engine.layers.attention import Attention, AttentionMetadata
from local_engine.layers.backend import select_ops
from local_engine.layers.norm import RMSNorm
from local_engine.layers.rotary import build_cos_sin_cache

__all__ = ["Attention", "AttentionMetadata", "RMSNorm", "build_cos_sin_cache", "select_ops"]
