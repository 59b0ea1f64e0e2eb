"""Dataset tools: what a user runs on a folder of images before training (the WD tagger, ...),
as functions taking paths and options and reporting progress through a callback, so that the
scripts in finetune/ and the web UI's jobs share them."""
