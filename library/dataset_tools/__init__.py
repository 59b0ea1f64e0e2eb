"""Dataset tools as functions (paths and options in, results out): the scripts in finetune/ and tools/ and the web UI call them."""
