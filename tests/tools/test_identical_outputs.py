"""benchmarks/identical_outputs.py stays runnable: every one of its nine runs is a command line its
entry script accepts (parsed as the run would be, no weights), and it covers every family and
method (issue 38's list)."""
from __future__ import annotations

import importlib.util
import os

from library.config import method_kinds
from library.config.options import METHOD_OF_SCRIPT
from library.config.parse import parse_args
from library.models.families import registry
from tools.make_sample_dataset import make_sample_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location("identical_outputs",
                                                  os.path.join(ROOT, "benchmarks", "identical_outputs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_run_parses_and_every_family_and_method_is_covered(tmp_path):
    mod = _module()
    data = str(tmp_path / "data")
    make_sample_dataset(data, n_images=2, size=64, repeats=2)
    dop = tmp_path / "dop.toml"
    dop.write_text("[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\n"
                   f"image_dir = {str(tmp_path / 'data' / '2_sks shape')!r}\n{mod.DOP}\n")
    families, methods = set(), set()
    for name, (script, args) in mod.runs(data, mod.LECO_PROMPTS, str(dop)).items():
        entry = script[:-3]
        opts = parse_args(entry, [*args, "--output_dir", str(tmp_path / name)])
        model = opts.pretrained_model_name_or_path
        families |= {f.name for f in registry.FAMILIES.values() if model in f.tiny_models}
        methods.add(METHOD_OF_SCRIPT.get(entry, "leco"))
    assert families == set(registry.FAMILIES)
    assert methods == set(method_kinds.KINDS)
