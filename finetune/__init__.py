"""sd-scripts' finetune/ tools by their names and flags (the WD tagger, ...)."""
