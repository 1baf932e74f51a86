"""Tools around the library and the trainer, each a command: ``python -m simplesharded.tools.X``.

bench (step time and memory against DDP and FSDP2, side by side), bench_collectives,
bench_passes (our passes' compile time), bench_moe, forecast (a config's step time and memory
at cluster scale, from its traced graphs on a fake process group: cluster_trace.py), calibrate
(this machine's numbers for the cost model), report (collectives per step, per backend).
bench_variants, bench_run and bench_table are bench's parts, not commands."""
