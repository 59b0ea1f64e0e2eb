"""library/safetensors_file.py's save_streaming: a file written one tensor at a time reads back with
safetensors' own reader, tensors and metadata equal; each tensor is converted only while it is
written (the previous one's converted copy is gone: what mem_eff_save promises)."""
from __future__ import annotations

import gc
import weakref

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library import safetensors_file


def test_streamed_file_reads_back_equal(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g).bfloat16(),
               "c": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "empty": torch.zeros(0, 3),
               "flag": torch.tensor([True, False]), "half": torch.randn(2, 2, generator=g).half()}
    path = str(tmp_path / "x.safetensors")
    safetensors_file.save_streaming(tensors, path, {"k": "v", "n": 3})
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn
                                                        else back[k], v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v), k
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"k": "v", "n": "3"}


def test_one_converted_tensor_at_a_time(tmp_path):
    tensors = {f"t{i}": torch.randn(64, 64) for i in range(5)}
    alive, peak = [], [0]

    def convert(t):
        out = t.to(torch.bfloat16)
        if t.device.type != "meta":
            gc.collect()
            peak[0] = max(peak[0], sum(r() is not None for r in alive) + 1)
            alive.append(weakref.ref(out))
        return out

    path = str(tmp_path / "y.safetensors")
    safetensors_file.save_streaming(tensors, path, None, convert)
    assert peak[0] == 1 and len(alive) == 5
    back = load_file(path)
    for k, v in tensors.items():
        assert torch.equal(back[k], v.to(torch.bfloat16)), k
