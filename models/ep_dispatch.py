"""Expert parallelism's token dispatch: a MoE layer's routed (token, choice) rows sent to
the ranks owning their experts, run there, and sent back (``dispatch``), and the dynamo
setting a compiled expert-parallel model runs under (``ep_compile_config``). The layer
(models/moe.py) routes and weighs; its ``ExpertParallel`` style splits the weights and names
the ep group this file's all-to-alls run on.

Under expert parallelism the routed experts' weights are split by expert over the ep ranks
(``ExpertParallel``: Shard(0), E/ep consecutive experts each). Each rank routes its own tokens
exactly as without EP (models/moe.py), sorts its (token, choice) rows by expert (so by owner
rank), exchanges the per-expert row counts with one equal-split all-to-all, sends the rows with
a variable-split all-to-all, runs its local experts on what it received through the same
grouped path ("sorted", received rows grouped by local expert, each expert's rows in (source
rank, token) order) and sends the results back by the reverse all-to-all; the weighting, the
sum over choices and the shared experts stay on the token's own rank. Per row the arithmetic is
the one of the local layer, so the layer's output equals the unsplit layer's (rounding aside in
the expert weights' gradient sums). The load-balancing counts (``tokens_per_expert``) and the
aux loss are each rank's own routing, as without EP; the trainer sums the counts over all
ranks.

Compile-friendly form: the split sizes are data-dependent. They are read with ``.tolist()``
(under ``ep_compile_config()``, dynamo's ``capture_scalar_outputs`` scoped to the compiled
call, never set globally), so under torch.compile they are unbacked SymInts and the received
rows a symbolic size; each gets the balanced count as its optimisation hint (what the cost
model and the planner read: ``torch._dynamo.override_optimization_hint``). The alternative, a
static padded exchange (every rank sends every peer a slot of T*min(k, E/ep) rows, what one
peer can be sent at most, so all shapes are static), moves ep*min(k, E/ep)/k times the bytes
routing asks for in each of the four token all-to-alls of a layer's step, and holds that much
memory for the slots: 8x on the 16B flavor at ep 8 (k 6, 8 experts per rank), 11x at ep 64.
``python -m simplesharded.tools.forecast --config configs/deepseek_v3_16b.toml --world-size 64`` counts
9.2 GB of all-to-all per rank and step at ep 8; padded, 73 GB, on the link every MoE layer
waits for. The unbacked form costs one host read of 2*ep integers per layer (a device-to-host
sync on GPU, which torchtitan's dispatch makes too; on CPU nothing: gloo's variable all-to-all
takes host splits anyway) and data-dependent shapes in the graph, which our passes read
through the optimisation hints.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback

from simplesharded.passes.annotations import ROUTING_KEY
from simplesharded.passes.torch_compat import override_optimization_hint


def dispatch(src, flat, keep, kept, group: str, size: int, dropless: bool, run_local):
    """The routed experts under expert parallelism (module doc): rows to the ranks owning
    their experts, the local experts on the rows received, results back. ``src`` [T*k, dim]
    in (token, choice) order, ``flat`` their experts, ``keep`` within capacity, ``kept``
    [E] rows kept per expert; ``group`` and ``size``: the ep process group's name and size;
    ``dropless``: no capacity; ``run_local(rows, experts, pos, keep, kept)``: the layer's
    grouped path (MoE._run_sorted) on this rank's experts. Returns [T*k, dim] in src order
    (dropped rows 0)."""
    P, E = size, kept.shape[0]
    El, (Tk, D) = E // P, src.shape
    with fx_traceback.annotate({ROUTING_KEY: True}):
        # Rows by expert, so by owner rank (experts are split in consecutive runs); the
        # stable sort keeps token order; dropped rows go last and are not sent.
        order = torch.argsort(flat if dropless else torch.where(keep, flat, E), stable=True)
        place = torch.empty_like(order).scatter_(0, order, torch.arange(Tk, device=src.device))
        # recv[q * El + j]: rows rank q sends to my local expert j
        recv = funcol.all_to_all_single(kept, None, None, group)
        splits = torch.cat([kept.view(P, El).sum(1), recv.view(P, El).sum(1)]).tolist()
    send_splits, recv_splits = splits[:P], splits[P:]
    for n in splits:  # balanced routing: what the cost model assumes (module doc)
        torch._check(n >= 0)
        override_optimization_hint(n, Tk // P)
    n_send = Tk if dropless else sum(send_splits)
    if dropless:
        torch._check(sum(send_splits) == Tk)
    rows = funcol.all_to_all_single_autograd(src[order[:n_send]], recv_splits,
                                             send_splits, group)
    R = sum(recv_splits)
    with fx_traceback.annotate({ROUTING_KEY: True}):
        # Received rows come by source rank q, then local expert j: block b = q * El + j.
        C = recv.view(P, El)
        sizes = C.flatten()
        block = torch.repeat_interleave(torch.arange(P * El, device=src.device), sizes,
                                        output_size=R)
        starts = sizes.cumsum(0) - sizes  # each block's first row in what was received
        ahead = (C.cumsum(0) - C).flatten()  # rows of expert j from ranks before q
        pos = ahead[block] + torch.arange(R, device=src.device) - starts[block]
    out = run_local(rows, block % El, pos, None, C.sum(0))
    back = funcol.all_to_all_single_autograd(out, send_splits, recv_splits, group)
    if not dropless:
        back = torch.cat([back, back.new_zeros(Tk - n_send, D)])
    return back[place]


def ep_compile_config():
    """The dynamo setting a compiled expert-parallel model runs under (module doc): enter it
    around each call of the compiled model (the trainer does, simplesharded/trainer/recipe.py)."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True)
