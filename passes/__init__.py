"""simplesharded.passes: FX passes over graphs that contain functional collectives."""
from .collectives import Collective, count_collectives, find_collectives
from .pipeline import PassPipeline, aot_backend, inductor_backend
from .recompute import tag_gathers_for_recompute

__all__ = ["Collective", "count_collectives", "find_collectives", "PassPipeline", "aot_backend",
           "inductor_backend", "tag_gathers_for_recompute"]
