"""Pipeline parallelism (`parallel.strategy: pipeline`): the layout of ranks and parts, the
partitioner (layout.py, no torch) and a rank's stages and schedule (stages.py)."""
