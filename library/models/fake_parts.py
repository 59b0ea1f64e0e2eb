"""What a family's memory-estimate hook builds its fake model from (library/training/flow_memory.py
runs it inside a FakeTensorMode): safetensors headers and config files, never tensor data.

    Unavailable          this source is not covered by the estimate (one line)
    Counted(n, name)     a frozen part known only by its size: one flat parameter
    Shape(shape)         a header's shape where a loader's detection reads ``.shape``
    header_numel(path, option, header, source)   parameters of a file named by an option
    folder_shapes(folder, header), folder_numel(folder, header)   a diffusers component folder
    t5_model(shapes, path, config), t5_file(path, header, source) T5 as library/models/t5.py builds it

``header(path) -> ({name: shape}, metadata)`` reads one safetensors header.
"""
from __future__ import annotations

import glob
import os

import torch
from torch import nn
from transformers import T5Config, T5EncoderModel

from library.models import embedded_config, t5


class Unavailable(Exception):
    """This source is not covered by the memory estimate (one line)."""


class Counted(nn.Module):
    """A frozen part known only by its size (from a file header): one flat parameter."""

    def __init__(self, numel: int, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel), requires_grad=False)
        self.source = name


class Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def numel(shapes: dict) -> int:
    """Parameters of {name: shape} (an autoencoder's: no tied tensors)."""
    return sum(int(torch.Size(s).numel()) for s in shapes.values())


def header_numel(path: str, option: str, header, source: str) -> int:
    if not path:
        raise Unavailable(f"{option}: required with {source}")
    shapes, _ = header(os.path.expanduser(path))
    return numel(shapes)


def folder_shapes(folder: str, header) -> dict:
    """{name: shape} of a diffusers / transformers component folder (all its .safetensors shards)."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise Unavailable(f"{folder}: no .safetensors weights to count")
    return {k: s for f in files for k, s in header(f)[0].items()}


def folder_numel(folder: str, header) -> int:
    """The parameters of a diffusers / transformers component folder: its .safetensors headers."""
    return numel(folder_shapes(folder, header))


def t5_model(shapes: dict, path: str, config: dict | None = None) -> nn.Module:
    """T5 as t5.model_from_state_dict builds it: a T5EncoderModel of ``config``, else of the
    config the weights' shapes give."""
    cfg = config or t5.config_from_state_dict({k: Shape(s) for k, s in shapes.items()}, path)
    return T5EncoderModel(T5Config(**cfg))


def t5_file(path: str, header, source: str) -> nn.Module:
    """A run's ``t5xxl`` file, as t5.load_t5 builds it (its record's config, else its shapes')."""
    if not path:
        raise Unavailable(f"t5xxl: required with {source}")
    path = os.path.expanduser(path)
    shapes, meta = header(path)
    record = embedded_config.read_record(meta, t5.META_CONFIG_KEY, path)
    return t5_model(shapes, path, (record or {}).get("config"))


def t5_output_bytes(t5_encoder) -> int:
    """Bytes per element of T5's output states: transformers' T5LayerNorm returns its weight's
    dtype (a float32 T5 under bf16 autocast gives float32 states, a bf16 or fp8-stored one the
    compute dtype, which its norm weights are kept in)."""
    return t5_encoder.encoder.final_layer_norm.weight.element_size()
