"""The learner on N ranks of one process group, sharded with PyTorch's FSDP2 (`shard`):
the ranks (`rank`), as local processes (`host`) or Ray actors (`ray`), and their sharded
checkpoints (`dcp`)."""
