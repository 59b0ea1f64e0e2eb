"""What a run writes: atomic saves, metadata, training states, output checks, trackers."""
