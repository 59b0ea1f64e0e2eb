"""Frozen parts after caching: once latents are cached the VAE, and once text-encoder outputs are
cached the text encoders (with a FLUX.1 / SD3 partial cache: T5 alone, the CLIP encoders train),
leave the training device for the rest of the run.

- On CUDA they move to the CPU (sd-scripts' behaviour) and come back to the device for the
  moments that need them: sample images, and the save of a full model (its file holds them).
  ``highvram`` keeps them on the device.
- On the CPU there is nowhere to move them, so their tensors are freed. When a later moment needs
  them (sample images; a full model's save, on the process that writes it) they are first written
  to a spill file in the temporary folder and read back for that moment, bit for bit; otherwise
  they are freed for good.

The run logs what it released and the memory that saved (CUDA: allocated bytes; CPU: resident
set, after returning freed heap pages to the system).

    release_after_caching(opts, device, b, method, caches, log) -> Frozen   at the end of the cache stage
    Frozen.available(*names)                                                context: the named parts are usable inside
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from typing import TYPE_CHECKING

from library import safetensors_file
from library.accelerator import is_main_process
from library.training.host_memory import GIB, resident_bytes, trim_heap

if TYPE_CHECKING:  # annotations only
    from library.config.parse import Options

logger = logging.getLogger("sdtk")


def size_text(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 1024 ** 2:.1f} MiB"


def _tensors(module) -> dict:
    """Every parameter and buffer by name (non-persistent buffers too: CLIP's position ids)."""
    out = {f"p.{n}": p for n, p in module.named_parameters(remove_duplicate=False)}
    out.update({f"b.{n}": b for n, b in module.named_buffers(remove_duplicate=False)})
    return out


def _ties(module) -> list:
    """(module, name, owner, owner's name) for each parameter that is also reachable under an
    earlier name: moving to and from the meta device makes new parameters, which must be re-tied."""
    first: dict[int, tuple] = {}
    out: list[tuple] = []
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                out.append((mod, name, *first[id(p)]))
            else:
                first[id(p)] = (mod, name)
    return out


def _retie(ties: list) -> None:
    for mod, name, owner, owner_name in ties:
        setattr(mod, name, getattr(owner, owner_name))


def module_bytes(module) -> int:
    seen, total = set(), 0
    for t in _tensors(module).values():
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _write_spill(module, path: str) -> None:
    """All tensors of ``module`` (CPU) in a safetensors file (written from the tensors, no copy)."""
    tensors, seen = {}, {}
    for name, t in _tensors(module).items():
        if t.data_ptr() in seen:  # a shared tensor is stored once
            continue
        seen[t.data_ptr()] = name
        tensors[name] = t.detach().contiguous()
    safetensors_file.save(tensors, path)


def _read_spill(module, path: str) -> None:
    """Fill ``module``'s (just allocated) tensors from its spill file, reading straight into them
    (no second copy, no memory map left resident)."""
    # lazy: the dry run's plan loads this module before torch; torch is imported when _read_spill()
    # runs
    import torch

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        for name, t in _tensors(module).items():
            entry = header.get(name)
            if entry is None:
                continue  # shared with an earlier name: filled through it
            start, end = entry["data_offsets"]
            f.seek(base + start)
            view = t.detach().view(-1).view(torch.uint8).numpy()
            if f.readinto(memoryview(view)) != end - start:
                raise RuntimeError(f"spill file {path}: truncated at {name}")


class Part:
    def __init__(self, key: str, name: str, modules: list):
        self.key, self.name, self.modules = key, name, modules
        self.bytes = sum(module_bytes(m) for m in modules)
        self.ties = [_ties(m) for m in modules]
        self.params = sum(p.numel() for m in modules for p in m.parameters())
        self.spills: list[str] | None = None  # CPU: spill files; None: freed for good
        self.away = False


class Frozen:
    """The released parts of one run and how to bring them back."""

    def __init__(self, device, keep_on_device: bool):
        self.device = device
        self.keep = keep_on_device
        self.parts: dict[str, Part] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None

    def release(self, parts: list[Part], needed_later: bool, log: logging.Logger = logger) -> None:
        # lazy: the dry run's plan loads this module before torch; torch is imported when release()
        # runs
        import torch

        if self.keep or not parts:
            return
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.device) if cuda else resident_bytes()
        for part in parts:
            if cuda:
                for m in part.modules:
                    m.to("cpu")
            else:
                if needed_later:
                    if self._tmp is None:
                        self._tmp = tempfile.TemporaryDirectory(prefix="sdtk-frozen-")
                    part.spills = []
                    for i, m in enumerate(part.modules):
                        path = os.path.join(self._tmp.name, f"{part.name}-{i}.safetensors")
                        _write_spill(m, path)
                        part.spills.append(path)
                self._to_meta(part)
            part.away = True
            self.parts[part.key] = part
        if cuda:
            torch.cuda.empty_cache()
            after = torch.cuda.memory_allocated(self.device)
            where, what = "moved to the CPU", "device memory allocated"
        else:
            trim_heap()
            after = resident_bytes()
            where = "freed (kept in a spill file for samples and saves)" if needed_later else "freed"
            what = "resident memory"
        names = ", ".join(f"{p.name} ({p.params / 1e6:.1f} M parameters, {size_text(p.bytes)})"
                          for p in parts)
        measured = ""
        if before is not None and after is not None:
            measured = f"; {what} {size_text(before)} -> {size_text(after)}"
        log.info(f"after caching: {names} {where}{measured}")
        self.saved_bytes = sum(p.bytes for p in parts)
        self.measured = (before, after)

    @contextlib.contextmanager
    def available(self, *names: str):
        """The named parts ("vae", "text_encoders"; all released ones when none are named)
        usable inside."""
        parts = [p for n, p in self.parts.items() if (not names or n in names) and p.away]
        for p in parts:
            self._restore(p)
        try:
            yield
        finally:
            for p in parts:
                self._away(p)

    def _restore(self, part: Part) -> None:
        if self.device.type == "cuda":
            for m in part.modules:
                m.to(self.device)
        else:
            if part.spills is None:
                raise RuntimeError(f"{part.name} was freed after caching and is needed again "
                                   "(the release decision missed a use)")
            for m, ties, path in zip(part.modules, part.ties, part.spills):
                m.to_empty(device="cpu")
                _retie(ties)
                _read_spill(m, path)
        part.away = False

    def _away(self, part: Part) -> None:
        if self.device.type == "cuda":
            # lazy: the dry run's plan loads this module before torch; torch is imported when
            # _away() runs
            import torch

            for m in part.modules:
                m.to("cpu")
            torch.cuda.empty_cache()
        else:
            self._to_meta(part)
            trim_heap()
        part.away = True

    @staticmethod
    def _to_meta(part: Part) -> None:
        for m, ties in zip(part.modules, part.ties):
            m.to("meta")
            _retie(ties)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def released_after_caching(*, latents_cached: bool, text_cached: bool,
                           text_encoders_trained: bool, highvram: bool,
                           partial_text: bool = False) -> tuple[str, ...]:
    """The parts that leave the device after caching: "vae" (its latents are cached),
    "text_encoders" (their outputs are cached and they do not train), "cached_text_encoders"
    (``partial_text``: FLUX.1 / SD3's T5, whose outputs a partial cache holds while the CLIP
    encoders train, as sd-scripts moves T5 to the CPU); none with ``highvram``. The one rule
    for the run (``release_after_caching``) and the memory estimate."""
    if highvram:
        return ()
    out: tuple[str, ...] = ("vae",) if latents_cached else ()
    if text_cached and partial_text:  # the CLIP encoders run every step
        out += ("cached_text_encoders",)
    elif text_cached and not text_encoders_trained:
        out += ("text_encoders",)
    return out


def release_after_caching(opts: Options, device, b, method, caches, log: logging.Logger = logger,
                          partial_encoders: tuple[int, ...] = ()) -> Frozen:
    """Release from ``device`` what the rest of the run does not need of the bundle ``b`` (its
    VAE, text encoders), given the ``caches`` made and what the ``method`` trains (see the
    module doc); ``partial_encoders``: the text encoders whose outputs a partial cache holds."""
    frozen = Frozen(device, keep_on_device=bool(opts.highvram))
    released = released_after_caching(
        latents_cached=caches.latents is not None, text_cached=caches.text is not None,
        text_encoders_trained=method.train_text_encoder, highvram=bool(opts.highvram),
        partial_text=caches.text_partial)
    parts = []
    if "vae" in released:
        parts.append(Part("vae", "VAE", [b.vae]))
    if "text_encoders" in released:
        parts.append(Part("text_encoders", "text encoders" if len(b.text_encoders) > 1 else "text encoder",
                          list(b.text_encoders)))
    held = [b.text_encoders[i] for i in partial_encoders if i < len(b.text_encoders)]
    if "cached_text_encoders" in released and held:  # T5 (an SD3 model without one: nothing)
        parts.append(Part("cached_text_encoders", "T5-XXL", held))
    # Later uses: sample images (every process renders its share of the prompts), and a full
    # model's save (the process that writes it). Validation uses cached latents and encodings.
    needed_later = bool(opts.sample_prompts) or (method.saves_full_model and is_main_process())
    frozen.release(parts, needed_later, log)
    return frozen


def available_for_save(frozen: Frozen, method):
    """The parts a model save writes: a full model's file holds the VAE and text encoders, so
    released ones come back for the save; a LoRA's or an embedding's does not (a no-op)."""
    if not method.saves_full_model:
        return contextlib.nullcontext()
    return frozen.available()
