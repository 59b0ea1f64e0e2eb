"""finetune.py end to end on the built-in tiny models, and its metadata files.

Datasets come from metadata: ``in_json`` (with ``train_data_dir`` as the image folder, as sd-scripts'
fine_tune.py) or a dataset config subset's ``metadata_file``; JSON ``{image: {caption, tags}}`` or
JSONL lines ``{image_path, caption, tags}``. Each run is 2 steps at 64 px with cached latents."""
import json
import logging
import os

import pytest
import torch
from tests.conftest import read

from library.data import folders as data
from library.errors import DataError


def tensors(module):
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def assert_equal(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()), f"{what}: {k}"


def differs(a, b):
    return any(not torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def image_folder(dataset):
    return os.path.join(dataset, "2_sks shape")


def write_json(path, doc):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return str(path)


def base(model, out, *extra):
    return ["--pretrained_model_name_or_path", model, "--output_dir", out, "--resolution", "64",
            "--max_train_steps", "2", "--learning_rate", "1e-3", "--cache_latents", *extra]


# -- metadata files (no model) --------------------------------------------------------------------
def test_metadata_caption_is_caption_then_tags():
    assert data.metadata_caption({"caption": "a dog", "tags": "dog, grass"}) == "a dog, dog, grass"
    assert data.metadata_caption({"caption": " a dog ", "tags": ""}) == "a dog"
    assert data.metadata_caption({"tags": "dog, grass"}) == "dog, grass"
    assert data.metadata_caption({"caption": "", "tags": None}) is None
    assert data.metadata_caption("not a table") is None


def test_scan_metadata_json_and_jsonl(dataset, tmp_path, caplog):
    folder = image_folder(dataset)
    js = write_json(tmp_path / "meta.json", {
        "shape_00": {"caption": "a red circle", "tags": "sks, shape"},     # by stem
        "shape_01.png": {"tags": "blue square"},                           # by name, tags only
        "missing": {"caption": "nothing here"},
        "shape_00.png": {"caption": "", "tags": ""},                       # no caption
    })
    with caplog.at_level(logging.WARNING):
        items = data.scan_metadata(js, folder, num_repeats=3, log=logging.getLogger("t"))
    assert [(os.path.basename(i.path), i.caption, i.num_repeats) for i in items] == [
        ("shape_00.png", "a red circle, sks, shape", 3), ("shape_01.png", "blue square", 3)]
    assert items[0].image_dir == folder and items[0].class_tokens is None
    lines = [r.getMessage() for r in caplog.records]
    assert sum("whose image is not found" in m and "'missing'" in m for m in lines) == 1
    assert sum("without a caption or tags: 'shape_00.png'" in m for m in lines) == 1

    jl = tmp_path / "meta.jsonl"
    jl.write_text("\n".join(json.dumps(e) for e in [
        {"image_path": os.path.join(folder, "shape_01.png"), "caption": "square"},  # absolute
        {"image_path": "shape_00.png", "caption": "circle", "tags": "red"}]) + "\n")
    items = data.scan_metadata(str(jl), folder, num_repeats=1)
    assert [(os.path.basename(i.path), i.caption) for i in items] == [
        ("shape_01.png", "square"), ("shape_00.png", "circle, red")]

    for text, msg in [("[1, 2]", "expected an object"), ("{", "is not JSON")]:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(DataError, match=msg):
            data.scan_metadata(str(tmp_path / "bad.json"), folder, num_repeats=1)
    (tmp_path / "bad.jsonl").write_text('{"caption": "x"}\n')
    with pytest.raises(DataError, match="line 1 is not an object with an image_path"):
        data.scan_metadata(str(tmp_path / "bad.jsonl"), folder, num_repeats=1)
    with pytest.raises(DataError, match="no usable entry"):
        data.scan_metadata(write_json(tmp_path / "none.json", {"x": {"caption": "y"}}), folder,
                           num_repeats=1)


# -- end to end -----------------------------------------------------------------------------------
def test_finetune_in_json_equals_the_same_data_as_folders(dataset, tmp_path, train):
    """in_json listing the folder's images with their caption files' text and the folder's
    repeats is the same training set: the same weights, bit for bit, as train_dreambooth on the
    folder. The saved file loads back equal to the in-memory model, text encoder included."""
    from library.models.loading import load_model_bundle

    folder = image_folder(dataset)
    doc = {}
    for stem in ("shape_00", "shape_01"):
        with open(os.path.join(folder, stem + ".caption"), encoding="utf-8") as f:
            cap, tags = f.read().strip().split(", ", 1)  # "sks shape, a red circle"
        doc[stem] = {"caption": cap, "tags": tags}
    doc["gone"] = {"caption": "no such image"}
    js = write_json(tmp_path / "meta.json", doc)
    out = tmp_path / "ft"
    rc, stdout, err, ft = train("finetune", base("tiny-sd15", out, "--in_json", js, "--train_data_dir",
                                                 folder, "--dataset_repeats", "2",
                                                 "--train_text_encoder"))
    assert rc == 0, err
    assert "skipping 1 entry whose image is not found" in err and "'gone'" in err
    assert "total_steps: 2" in stdout
    rc, _, err, db = train("train_dreambooth", base("tiny-sd15", tmp_path / "db", "--train_data_dir",
                                                     dataset, "--train_text_encoder"))
    assert rc == 0, err
    assert [i.caption for i in ft.tset.train_items] == [i.caption for i in db.tset.train_items]
    assert_equal(tensors(ft.parts.bundle.unet), tensors(db.parts.bundle.unet), "unet (finetune vs folders)")
    assert_equal(tensors(ft.parts.bundle.text_encoders[0]), tensors(db.parts.bundle.text_encoders[0]), "te")

    path = str(out / "last.safetensors")
    assert sorted(os.listdir(out)) == ["last.safetensors"]
    _, md = read(path)
    assert md["ss_train_text_encoder"] == "True"
    loaded, orig = load_model_bundle(path), load_model_bundle("tiny-sd15")
    assert_equal(tensors(loaded.unet), tensors(ft.parts.bundle.unet), "unet")
    assert_equal(tensors(loaded.text_encoders[0]), tensors(ft.parts.bundle.text_encoders[0]), "te")
    assert differs(tensors(loaded.unet), tensors(orig.unet))
    assert differs(tensors(loaded.text_encoders[0]), tensors(orig.text_encoders[0]))


@pytest.mark.parametrize("train_te", [False, True])
def test_finetune_sdxl_metadata_file_subset_diffusers(train_te, dataset, tmp_path, train):
    """SDXL from a dataset config subset's JSONL metadata_file, saved as a diffusers folder that
    loads back equal to the trained weights; the text encoders train only with train_text_encoder."""
    from library.models.loading import load_model_bundle

    folder = image_folder(dataset)
    jl = tmp_path / "meta.jsonl"
    jl.write_text("\n".join(json.dumps(e) for e in [
        {"image_path": "shape_00.png", "caption": "a red circle", "tags": "sks"},
        {"image_path": "shape_01.png", "caption": "a blue square"},
        {"image_path": "shape_01.png"}]) + "\n")
    toml = tmp_path / "data.toml"
    toml.write_text(f'[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\n'
                    f'image_dir = {json.dumps(folder)}\nmetadata_file = {json.dumps(str(jl))}\n'
                    f'num_repeats = 2\n')
    out = tmp_path / "out"
    extra = ["--train_text_encoder"] if train_te else []
    rc, _, err, run = train("finetune", [
        "--pretrained_model_name_or_path", "tiny-sdxl", "--output_dir", out, "--dataset_config",
        toml, "--max_train_steps", "2", "--learning_rate", "1e-3", "--cache_latents",
        "--save_model_as", "diffusers", *extra])
    assert rc == 0, err
    assert "skipping 1 entry without a caption or tags" in err
    assert [i.caption for i in run.tset.train_items] == ["a red circle, sks", "a blue square"]
    loaded, orig = load_model_bundle(str(out / "last")), load_model_bundle("tiny-sdxl")
    assert_equal(tensors(loaded.unet), tensors(run.parts.bundle.unet), "unet")
    assert differs(tensors(loaded.unet), tensors(orig.unet))
    for i, (te, te_run, te0) in enumerate(zip(loaded.text_encoders, run.parts.bundle.text_encoders,
                                              orig.text_encoders)):
        assert_equal(tensors(te), tensors(te_run), f"text encoder {i + 1}")
        assert differs(tensors(te), tensors(te0)) == train_te, i


def test_finetune_input_errors(dataset, tmp_path, run_script):
    folder = image_folder(dataset)
    rc, _, err = run_script("finetune", base("tiny-sd15", tmp_path / "o", "--in_json",
                                             tmp_path / "nope.json", "--train_data_dir", folder))
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: in_json ") \
        and "does not exist" in err
    rc, _, err = run_script("finetune", base("tiny-sd15", tmp_path / "o", "--train_data_dir", dataset,
                                             "--dataset_repeats", "3"))
    assert rc == 2 and "dataset_repeats applies to in_json metadata only" in err
    toml = tmp_path / "data.toml"
    toml.write_text('[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\n'
                    'metadata_file = "/no/such.json"\n')
    rc, _, err = run_script("finetune", ["--pretrained_model_name_or_path", "tiny-sd15",
                                         "--output_dir", tmp_path / "o", "--dataset_config", toml,
                                         "--max_train_steps", "1", "--dry_run"])
    assert rc == 2 and "datasets[0].subsets[0].metadata_file: file '/no/such.json' does not exist" in err
