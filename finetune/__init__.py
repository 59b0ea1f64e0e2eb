"""Dataset tools with sd-scripts' names and flags (run as scripts: python finetune/<tool>.py)."""
