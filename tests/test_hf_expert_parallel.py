"""A transformers experts module under HFExpertParallel (models/hf_expert_parallel.py) computes
what its own forward computes, for the layouts transformers records on it: Mixtral's (gate and
up fused, [E, out, in]), gpt-oss's (transposed, with biases and its own clamped gating). One
process, an ep mesh of one rank (the dispatch's all-to-alls then move nothing); the two-rank
split is trained in tests/test_hf_source.py."""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import world_of_one

transformers = pytest.importorskip("transformers")


def _experts(kind: str):
    if kind == "mixtral":
        config = transformers.MixtralConfig(hidden_size=16, intermediate_size=24,
                                            num_local_experts=4, num_experts_per_tok=2)
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls
    else:
        config = transformers.GptOssConfig(hidden_size=16, intermediate_size=24,
                                           num_local_experts=4, num_experts_per_tok=2)
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_dispatched_experts_compute_transformers_forward(kind):
    from torch.distributed.tensor.parallel import parallelize_module

    from simplesharded.models.hf_expert_parallel import HFExpertParallel

    module = _experts(kind)
    assert module.has_bias == (kind == "gpt_oss") and module.is_transposed == (kind == "gpt_oss")
    reference = copy.deepcopy(module)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 16, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=g)
    with world_of_one() as mesh:
        parallelize_module(module, mesh, HFExpertParallel())
        out = module(x.clone().requires_grad_(), index, weights)
        out.square().sum().backward()
    want = reference(x, index, weights)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for name, p in reference.named_parameters():
        got = getattr(module, name)
        torch.testing.assert_close(got.grad.to_local(), p.grad, rtol=1e-5, atol=1e-6,
                                   msg=name)


def test_a_module_without_the_recorded_layout_is_refused():
    from torch import nn
    from torch.distributed.tensor.parallel import parallelize_module

    from simplesharded.models.hf_expert_parallel import HFExpertParallel

    with world_of_one() as mesh, pytest.raises(ValueError, match=r"lacks num_experts"):
        parallelize_module(nn.Linear(4, 4), mesh, HFExpertParallel())
