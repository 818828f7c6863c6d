"""Fault-tolerant distributed training on Ray Train: worker loop, checkpoints, supervisor."""
