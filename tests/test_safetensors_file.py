"""Safetensors files are the same bytes whichever process writes them (library/safetensors_file.py):
safetensors 0.8 orders the metadata by a per-process hash map."""
import json
import os
import struct
import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library import safetensors_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META = {f"ss_key_{i:02d}": f"value {i} é" for i in range(40)}

WRITE = """
import sys, torch
from library import safetensors_file
meta = {f"ss_key_{i:02d}": f"value {i} \\u00e9" for i in range(40)}
tensors = {"b.weight": torch.arange(6, dtype=torch.float16).reshape(2, 3),
           "a.weight": torch.arange(4, dtype=torch.float32)}
safetensors_file.save(tensors, sys.argv[1], metadata=meta)
"""


def test_two_processes_write_the_same_bytes_and_the_file_reads_back(tmp_path):
    paths = [str(tmp_path / f"{i}.safetensors") for i in range(3)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for p in paths:
        subprocess.run([sys.executable, "-c", WRITE, p], env=env, check=True, timeout=120)
    data = [open(p, "rb").read() for p in paths]
    assert data[0] == data[1] == data[2]
    with safe_open(paths[0], "pt") as f:  # the safetensors reader takes the rewritten header
        assert f.metadata() == META
        assert f.get_tensor("b.weight").dtype == torch.float16
    got = load_file(paths[0])
    assert torch.equal(got["a.weight"], torch.arange(4, dtype=torch.float32))
    assert torch.equal(got["b.weight"], torch.arange(6, dtype=torch.float16).reshape(2, 3))
    n, header = safetensors_file.read_header(paths[0])
    assert list(header["__metadata__"]) == sorted(META) and (8 + n) % 8 == 0


def test_a_longer_header_rewrites_the_file_with_its_data_aligned(tmp_path):
    path = str(tmp_path / "x.safetensors")
    t = {"w": torch.linspace(-1, 1, 10, dtype=torch.float64)}
    safetensors_file.save(t, path, metadata={"k": "v"})
    n, header = safetensors_file.read_header(path)
    header["__metadata__"]["long"] = "x" * 1000
    safetensors_file.write_header(path, n, header)
    n2, _ = safetensors_file.read_header(path)
    assert n2 > n and (8 + n2) % 8 == 0
    with open(path, "rb") as f:
        assert struct.unpack("<Q", f.read(8))[0] == n2
        assert json.loads(f.read(n2))["__metadata__"]["long"] == "x" * 1000
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"k": "v", "long": "x" * 1000}
    assert torch.equal(load_file(path)["w"], t["w"])
