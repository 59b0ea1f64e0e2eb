"""Fill the latent disk cache ahead of training.

    python tools/cache_latents.py --config run.toml [--OPTION VALUE ...]
    accelerate launch --num_processes 2 tools/cache_latents.py --config run.toml

Takes the options of ``train_lora.py`` (``--script train_dreambooth`` for that script's), so the
run config that trains is the one that caches: the same images, buckets, flips, VAE, ``vae``,
``no_half_vae``, ``mixed_precision`` (the VAE's dtype) and ``cache_dir`` give the same cache keys,
and the training run with ``cache_latents_to_disk`` then loads every entry without running the
VAE. Training length and ``output_dir`` are not needed here. Entries already valid on disk are
kept; missing or corrupt ones are encoded. Under ``accelerate launch`` the missing entries are
split across the processes. (Text-encoder outputs are cached by the training run itself: they
take a fraction of a second per hundred captions.)
"""
from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from library import accelerator  # noqa: E402
from library.config.parse import ConfigError, parse_args  # noqa: E402
from library.data import latent_cache  # noqa: E402
from library.data.training_data import build_training_set  # noqa: E402
from library.errors import UserError  # noqa: E402
from library.log import logger, setup_logging  # noqa: E402
from library.models import loading  # noqa: E402


def _parse(script: str, argv: list[str]):
    argv = list(argv) + ["--dry_run"]  # nothing is trained: output_dir is not required
    try:
        return parse_args(script, argv)
    except ConfigError as e:
        if "training length is not set" not in str(e):
            raise
        return parse_args(script, argv + ["--max_train_steps", "1"])  # unused here


def cache_latents(opts, log):
    """Encode what is missing from the disk cache; -> (entries, images encoded, seconds)."""
    opts = opts.replace(cache_latents_to_disk=True)  # e.g. random_crop is then refused, as in training
    tset = build_training_set(opts, log)
    acc = accelerator.accelerator_for(opts)
    bundle = loading.load_from_options(opts)
    dtype = latent_cache.vae_dtype(opts)  # the trainer's, so the keys match
    vae = bundle.vae.to(acc.device, dtype=dtype).eval()
    started = time.perf_counter()
    with latent_cache.counting_encodes(vae) as calls:
        entries = latent_cache.encode_latents(
            vae, tset.train_items + tset.reg_items, batch_size=max(1, opts.vae_batch_size),
            dtype=dtype, device=acc.device, vae_identity=bundle.vae_identity, log=log,
            to_disk=True, processes=latent_cache.ProcessShare.of(acc))
    acc.wait_for_everyone()
    return acc, len(entries), sum(calls), time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    script = "train_lora"
    if "--script" in argv:
        i = argv.index("--script")
        script = argv[i + 1] if i + 1 < len(argv) else ""
        argv = argv[:i] + argv[i + 2:]
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip() + f"\n\nThe options of {script}.py follow.\n", flush=True)
    setup_logging(accelerator.is_main_process())
    try:
        opts = _parse(script, argv)
        acc, n, encoded, seconds = cache_latents(opts, logger)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if accelerator.is_main_process():
        rate = f", {encoded / seconds:.1f} images/s" if encoded and seconds > 0 else ""
        print(f"latent cache: {n} entries ready; this process encoded {encoded} in {seconds:.2f}s{rate}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
