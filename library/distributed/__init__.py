"""Several processes: the Accelerator, FSDP, DeepSpeed ZeRO."""
