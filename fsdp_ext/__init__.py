"""fsdp-ext: plugins for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``)."""
