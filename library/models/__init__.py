"""Loading models, the per-family adapters, checkpoint formats, dtype placement, fp8."""
