"""benchmarks/identity.py compare: every difference between two manifests is reported, key by
key; only a state's record of an option added since, at its schema default, is the same run."""
import json

from benchmarks import identity


def manifest(tensor_hash="aa", config=None, md=None):
    return {"lora": {"last.safetensors": {"metadata": md or {"ss_network_dim": "4"},
                                          "tensors": {"w": ["torch.float32", [2], tensor_hash]}},
                     "last-state/state.json": {"config": config or {"learning_rate": 0.01},
                                               "global_step": 4}}}


def compare(tmp_path, before, after, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(before))
    b.write_text(json.dumps(after))
    rc = identity.main(["compare", str(a), str(b)])
    return rc, capsys.readouterr().out


def test_identical_manifests_pass(tmp_path, capsys):
    rc, out = compare(tmp_path, manifest(), manifest(), capsys)
    assert rc == 0 and "1 runs, 2 files: identical" in out


def test_a_changed_tensor_metadata_or_state_key_is_named(tmp_path, capsys):
    for after, where in ((manifest(tensor_hash="bb"), "/lora/last.safetensors/tensors/w"),
                         (manifest(md={"ss_network_dim": "8"}),
                          "/lora/last.safetensors/metadata/ss_network_dim"),
                         (manifest(config={"learning_rate": 0.02}),
                          "/lora/last-state/state.json/config/learning_rate")):
        rc, out = compare(tmp_path, manifest(), after, capsys)
        assert rc == 1 and out.startswith(where + ":"), out


def test_a_new_option_passes_only_at_its_default(tmp_path, capsys):
    at_default = manifest(config={"learning_rate": 0.01, "timestep_sampling": "sigma"})
    assert compare(tmp_path, manifest(), at_default, capsys)[0] == 0
    changed = manifest(config={"learning_rate": 0.01, "timestep_sampling": "shift"})
    rc, out = compare(tmp_path, manifest(), changed, capsys)
    assert rc == 1 and "timestep_sampling" in out
    unknown = manifest(config={"learning_rate": 0.01, "no_such_option": 1})
    assert compare(tmp_path, manifest(), unknown, capsys)[0] == 1
