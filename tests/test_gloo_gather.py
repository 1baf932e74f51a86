"""simplesharded/shims/gloo_gather.py: on CPU the functional all-gather runs as gloo's plain
all-gather (not the coalesced one whose worker threads race on a shared string), in eager
DTensor code and in compiled graphs, with the same values. ``uninstall()`` gives torch's
kernel back; ``data_parallel`` installs it on a gloo mesh, and only there.

Torch's own CPU kernel is never run here: it is the one the shim replaces, and on two gloo
ranks it can hand back the output before the gather has filled it. Which kernel serves the op
is read from the dispatcher's table instead."""
import torch

from dist_utils import spawn

COALESCED = "c10d::allgather_into_tensor_coalesced_"
PLAIN = "c10d::_allgather_base_"


def _c10d_ops(fn) -> tuple[torch.Tensor, set[str]]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("c10d::")}


def _cpu_kernel() -> str:
    """Where the CPU kernel of the functional all-gather was registered (dispatcher table)."""
    table = torch._C._dispatch_dump_table("_c10d_functional::all_gather_into_tensor")
    return next(line for line in table.splitlines() if line.startswith("CPU:"))


def gather_job(rank, world):
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_gather_tensor
    from torch.distributed.tensor import Shard, distribute_tensor

    from simplesharded.shims import gloo_gather
    from simplesharded.mesh import build_mesh

    mesh = build_mesh(dp_shard=world, device="cpu")
    group = dist.group.WORLD
    full = torch.arange(4.0 * world * 3).reshape(4 * world, 3)
    shard = full.chunk(world)[rank].clone()

    def functional():
        return all_gather_tensor(shard, 0, group)

    def dtensor():
        return distribute_tensor(full, mesh, [Shard(0)]).full_tensor()

    compiled = torch.compile(lambda x: all_gather_tensor(x, 0, group) * 2, backend="aot_eager",
                             fullgraph=True)
    gloo_gather.uninstall()  # the spawned ranks start with it installed
    out = {"torch": _cpu_kernel()}
    gloo_gather.install()
    gloo_gather.install()  # idempotent
    out["functional"] = _c10d_ops(functional)
    out["dtensor"] = _c10d_ops(dtensor)
    out["compiled"] = _c10d_ops(lambda: compiled(shard))
    gloo_gather.uninstall()
    out["uninstalled"] = _cpu_kernel()
    import simplesharded as ss
    ss.data_parallel(torch.nn.Linear(4, 4), mesh)
    return {"full": full, "by_data_parallel": gloo_gather.installed(), **out}


def test_functional_gather_runs_gloos_plain_all_gather():
    for res in spawn(2, gather_job):
        full = res["full"]
        assert "gloo_gather.py" not in res["torch"], res["torch"]
        for path in ("functional", "dtensor"):
            value, ops = res[path]
            assert torch.equal(value, full), path
            assert PLAIN in ops and COALESCED not in ops, (path, ops)
        value, ops = res["compiled"]
        assert torch.equal(value, 2 * full)
        assert PLAIN in ops and COALESCED not in ops, ops
        assert res["uninstalled"] == res["torch"], res["uninstalled"]
        assert res["by_data_parallel"]


def test_data_parallel_leaves_torchs_kernel_off_gloo():
    from pass_utils import fake_world

    import simplesharded as ss
    from simplesharded.shims import gloo_gather

    gloo_gather.uninstall()
    with fake_world(2) as mesh:
        ss.data_parallel(torch.nn.Linear(4, 4), mesh)
    assert not gloo_gather.installed()
