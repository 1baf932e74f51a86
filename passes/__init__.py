"""simplesharded.passes: FX passes over graphs that contain functional collectives."""
from .bucketing import bucket_collectives
from .collectives import Collective, count_collectives, find_collectives
from .lowering import lower_reduce_scatters
from .pipeline import PassPipeline, aot_backend, inductor_backend
from .plan_protocol import Plan
from .plans import AutoPlan, BlockPlan
from .recompute import tag_gathers_for_recompute
from .reordering import reorder_for_overlap
from .replica_padding import pad_replica_all_reduces
from .view_cat import elide_view_cats

__all__ = ["bucket_collectives", "Collective", "count_collectives",
           "find_collectives", "lower_reduce_scatters", "PassPipeline", "aot_backend",
           "inductor_backend", "Plan",
           "AutoPlan", "BlockPlan", "tag_gathers_for_recompute", "reorder_for_overlap",
           "pad_replica_all_reduces", "elide_view_cats"]
