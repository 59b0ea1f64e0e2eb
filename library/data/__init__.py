"""From image folders to micro-batches: folder scan, buckets, decoding, augmentation, caches, the step plan."""
