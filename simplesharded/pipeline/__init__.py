"""Pipeline parallelism: cutting a model into stages at block boundaries (stage_split.py) and
running them with torch.distributed.pipelining's schedules, FSDP across a stage's
micro-batches (pipelining.py)."""
