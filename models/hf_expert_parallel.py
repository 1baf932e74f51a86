"""Expert parallelism for a Hugging Face MoE: transformers' experts modules split by expert
over the ep ranks, each layer's routed tokens sent to their experts' ranks and back.

transformers keeps a MoE layer's routed experts in one module (``MixtralExperts``,
``Qwen3MoeExperts``, ...) with 3-D weights ``[E, ...]`` and one
forward, ``experts(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]``;
the layer around it routes (and adds shared experts). Its class is declared with transformers'
``use_experts_implementation``, which records the weights' layout on each module
(``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``, and ``_apply_gate``,
the model's own gating). The config names these modules in ``base_model_ep_plan``
(``"ep_dispatch_experts"``), which :func:`ep_styles` reads, as models/hf_tensor_parallel.py
reads the tensor-parallel plan.

:class:`HFExpertParallel` (a torch ``ParallelStyle`` for ``parallelize_module`` on
``mesh["ep"]``) makes each weight a DTensor ``Shard(0)``: E/ep consecutive experts per rank,
which data_parallel shards further over the dp ranks EP left, as for the zoo's MoE. The
module's forward becomes the zoo's dispatch (models/ep_dispatch.py: the (token, choice) rows
sorted by expert, counts exchanged, rows sent by a variable all-to-all, this rank's experts
run on what arrived, results sent back): dropless, as transformers' own forward. The local
experts run on rows grouped by expert (models/expert_mm.py ``by_expert``, ``grouped_mm``) with
the module's own gating, biases and norm; the weighting by the router's scores and the sum over
choices are transformers' (``proj_out * weights``, summed over k), on the token's own rank.
Routing, the shared experts and the balancing loss are untouched: each rank's own tokens, as
without EP.

Refused before training (:func:`check_ep`): a config without the plan, an expert count the
degree does not divide, an experts class without the recorded layout.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .ep_dispatch import dispatch
from .expert_mm import by_expert, grouped_mm, local_experts, row_align
from .hf_plans import plan_matches

PLAN_STYLE = "ep_dispatch_experts"  # transformers' name for an experts module in the plan
# what transformers' use_experts_implementation records on an experts module
_LAYOUT = ("num_experts", "has_gate", "has_bias", "is_transposed", "has_post_expert_norm",
           "_apply_gate")


def _experts_count(text) -> int | None:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(text, key, None)
        if isinstance(value, int):
            return value
    return None


def _patterns(text) -> list[str]:
    plan = getattr(text, "base_model_ep_plan", None) or {}
    return [k for k, v in plan.items() if v == PLAN_STYLE]


def check_ep(model: nn.Module, ep: int) -> None:
    """ValueError naming what keeps ``model`` (built on the meta device) from splitting its
    experts over ``ep`` ranks: no plan, an expert count ``ep`` does not divide, or an experts
    module without transformers' recorded layout."""
    text = model.config.get_text_config()
    name = type(model.config).__name__
    if not _patterns(text):
        raise ValueError(f"expert_parallel_degree={ep}: {name} has no expert-parallel plan "
                         f"(base_model_ep_plan naming {PLAN_STYLE!r} modules) in transformers "
                         f"(use 1)")
    n = _experts_count(text)
    if n is None or n % ep:
        raise ValueError(f"expert_parallel_degree={ep} does not divide {name}'s number of "
                         f"experts ({n})")
    for fqn, module in _targets(model).items():
        missing = [a for a in _LAYOUT if not hasattr(module, a)]
        if missing:
            raise ValueError(f"expert_parallel_degree={ep}: {fqn} ({type(module).__name__}) "
                             f"is not a transformers experts module (it lacks "
                             f"{', '.join(missing)}); use 1")


def _targets(model: nn.Module) -> dict[str, nn.Module]:
    """FQN → experts module the plan names (those present: a pipeline stage lacks others)."""
    prefix = model.base_model_prefix
    modules = dict(model.get_submodule(prefix).named_modules())
    return {f"{prefix}.{n}": modules[n]
            for pattern in _patterns(model.config.get_text_config())
            for n in plan_matches(pattern, modules)}


def ep_styles(model: nn.Module) -> dict:
    """``parallelize_module``'s plan: each experts module → :class:`HFExpertParallel`."""
    return {fqn: HFExpertParallel() for fqn in _targets(model)}


class _Dispatched:
    """Mixed into an experts module's class by :class:`HFExpertParallel`: its forward with the
    rows dispatched to the ranks of their experts (module doc)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        (T, D), k = hidden_states.shape, top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)  # (token, choice) rows, token-major
        counts = torch.zeros(self.num_experts, dtype=torch.int64,
                             device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        src = hidden_states[:, None, :].expand(T, k, D).reshape(T * k, D)
        out = dispatch(src, flat, None, counts, self.ep_group, self.ep_size, True,
                       self._run_local)
        weighted = out * top_k_weights.reshape(-1, 1)
        return weighted.view(T, k, D).sum(1).to(hidden_states.dtype)

    def _run_local(self, rows, experts, pos, keep, kept):
        """This rank's experts on the rows received (``experts``: local expert of each)."""
        up, down = self._weights()  # each read once (a read gathers over the dp ranks)
        return by_expert(rows, experts, pos, kept, row_align(rows, up),
                         lambda x, offs: self._grouped(x, offs, up, down))

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts' up (or gate-up) and down weights, each [E/ep, in, out]."""
        up = self.gate_up_proj if self.has_gate else self.up_proj
        up, down = local_experts(up), local_experts(self.down_proj)
        if not self.is_transposed:  # stored [E, out, in]
            up, down = up.transpose(1, 2), down.transpose(1, 2)
        return up, down

    def _grouped(self, x, offs, up, down):
        """x [N, D] grouped by local expert (``offs``: group ends) through the experts."""
        gate = self.has_gate
        bias = None
        if self.has_bias:  # each row's expert, from the group ends
            which = torch.searchsorted(offs, torch.arange(x.shape[0], dtype=offs.dtype,
                                                          device=x.device), right=True)
            which = which.clamp(max=offs.shape[0] - 1)
            bias = (local_experts(self.gate_up_proj_bias if gate else self.up_proj_bias),
                    local_experts(self.down_proj_bias))
        h = grouped_mm(x, up, offs)
        if bias is not None:
            h = h + bias[0][which]
        h = self._apply_gate(h) if gate else self.act_fn(h)
        h = grouped_mm(h, down, offs)
        if bias is not None:
            h = h + bias[1][which]
        return self.post_expert_norm(h) if self.has_post_expert_norm else h


_CLASSES: dict[type, type] = {}


class HFExpertParallel(ParallelStyle):
    """Split a transformers experts module over a 1-D mesh (``mesh["ep"]``): each weight
    ``[E, ...]`` a DTensor ``Shard(0)``, and its forward the dispatch (module doc). No
    communication: each rank keeps its own experts of the full weights it holds (the same on
    every rank by construction, or on meta)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        missing = [a for a in _LAYOUT if not hasattr(module, a)]
        if missing:
            raise ValueError(f"HFExpertParallel applies to transformers experts modules; "
                             f"{type(module).__name__} lacks {', '.join(missing)}")
        if module.num_experts % device_mesh.size():
            raise ValueError(f"{device_mesh.size()} ep ranks do not divide "
                             f"{module.num_experts} experts")
        for name, p in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(p.detach(), device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
        cls = type(module)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(cls.__name__, (_Dispatched, cls), {})
        module.__class__ = _CLASSES[cls]
        module.ep_group = device_mesh.get_group().group_name
        module.ep_size = device_mesh.size()
        return module
