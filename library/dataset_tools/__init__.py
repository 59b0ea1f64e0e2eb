"""Dataset tools: tag, caption and lay out a training folder (issue 33)."""
