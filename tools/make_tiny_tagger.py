"""Write a tiny WD tagger (random weights, fixed seed) in either layout sd-scripts' tagger reads,
for tests and benchmarks: no download.

    python tools/make_tiny_tagger.py OUT_DIR [--layout smilingwolf|tag_mapping] [--batch N]

smilingwolf: OUT_DIR/model.onnx (NHWC float32 448x448 BGR 0..255 in, one sigmoid per label out)
and OUT_DIR/selected_tags.csv (4 ratings, 12 general and 4 character tags); tag_mapping:
OUT_DIR/model_optimized.onnx (NCHW, -1..1 in, logits out) and OUT_DIR/tag_mapping.json (a label of
every category). Needs the onnx package (the test extra). ``make_images``: the images the tests
and benchmarks/sd_scripts_tagger_check.py tag (every preprocessing path).

The graph: input -> (NHWC: Transpose to NCHW) -> AveragePool 56x56 (an 8x8 grid per channel,
so the score depends on where the pixels are and which channel they are in) -> Flatten -> Gemm
-> Sigmoid (SmilingWolf layout: probabilities) or nothing (tag_mapping layout: logits).
Per label: logit = bias + w . (pooled - centre), the weights from a fixed seed, the biases set
per tag so that some tags pass the default threshold on every image and others depend on it.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import numpy as np
from PIL import Image

SIZE = 448
GRID = 8

RATINGS = ["general", "sensitive", "questionable", "explicit"]
GENERAL = ["1girl", "solo", "long_hair", "smile", "^_^", "open_mouth", "blue_eyes",
           "simple_background", "white_background", "holding_sword", "a,b", "looking_at_viewer"]
CHARACTERS = ["hatsune_miku", "kafuu_chino_(gochuumon_wa_usagi_desu_ka?)",
              "saber_(fate)_(cosplay)", "zz_char"]
# biases (logits): clearly in, clearly out, or image-dependent
GENERAL_BIAS = [4.0, 2.5, 0.0, -0.3, 3.0, -5.0, 0.3, 1.0, -1.0, 0.5, 2.0, -0.6]
CHARACTER_BIAS = [3.5, 3.0, 0.2, -4.0]
RATING_BIAS = [0.5, 0.0, -0.5, -1.0]

# tag_mapping layout: categories of its labels (in output order), with biases
MAPPING = [("general", "Rating", 0.5), ("explicit", "Rating", -0.5),
           ("masterpiece", "Quality", 1.0), ("worst_quality", "Quality", -1.0),
           ("1girl", "General", 4.0), ("solo", "General", 1.5), ("smile", "General", 0.0),
           ("blue_eyes", "General", -0.4),
           ("hatsune_miku", "Character", 3.0), ("saber_(fate)", "Character", 2.0),
           ("vocaloid", "Copyright", 1.2), ("highres", "Meta", 0.8), ("sdxl", "Model", -0.2),
           ("some_artist", "Artist", 0.6)]


def _graph(n_labels: int, biases: list[float], nchw: bool, sigmoid: bool, batch, seed: int):
    import onnx  # lazy: a test dependency, not the toolkit's
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    feats = 3 * GRID * GRID
    w = rng.normal(0.0, 1.0, (feats, n_labels)) * (3.0 / np.sqrt(feats))
    if nchw:  # input already centred, -1..1
        b = np.asarray(biases, np.float64)
    else:     # 0..255: centre at 127.5 and scale inside the weights
        w = w / 127.5
        b = np.asarray(biases, np.float64) - 127.5 * w.sum(axis=0)
    shape = [batch, 3, SIZE, SIZE] if nchw else [batch, SIZE, SIZE, 3]
    x = helper.make_tensor_value_info("input_1:0" if not nchw else "input", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("predictions_sigmoid" if sigmoid else "output",
                                      TensorProto.FLOAT, [batch, n_labels])
    k = SIZE // GRID
    nodes, src = [], x.name
    if not nchw:
        nodes.append(helper.make_node("Transpose", [src], ["nchw"], perm=[0, 3, 1, 2]))
        src = "nchw"
    nodes += [helper.make_node("AveragePool", [src], ["pooled"], kernel_shape=[k, k], strides=[k, k]),
              helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
              helper.make_node("Gemm", ["flat", "W", "B"], ["logits" if sigmoid else y.name])]
    if sigmoid:
        nodes.append(helper.make_node("Sigmoid", ["logits"], [y.name]))
    inits = [numpy_helper.from_array(w.astype(np.float32), "W"),
             numpy_helper.from_array(b.astype(np.float32), "B")]
    graph = helper.make_graph(nodes, "tiny_wd_tagger", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by older onnxruntime builds too
    onnx.checker.check_model(model)
    return model


def build_smilingwolf(folder: str, *, batch="N", seed=0) -> str:
    """model.onnx + selected_tags.csv (4 ratings, the general tags, the character tags)."""
    import onnx  # lazy: a test dependency, not the toolkit's

    os.makedirs(folder, exist_ok=True)
    rows = ([(i, n, "9") for i, n in enumerate(RATINGS)]
            + [(100 + i, n, "0") for i, n in enumerate(GENERAL)]
            + [(200 + i, n, "4") for i, n in enumerate(CHARACTERS)])
    with open(os.path.join(folder, "selected_tags.csv"), "w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(["tag_id", "name", "category", "count"])
        for tag_id, name, cat in rows:
            wr.writerow([tag_id, name, cat, 1000])
    model = _graph(len(rows), RATING_BIAS + GENERAL_BIAS + CHARACTER_BIAS, nchw=False,
                   sigmoid=True, batch=batch, seed=seed)
    onnx.save(model, os.path.join(folder, "model.onnx"))
    return folder


def build_tag_mapping(folder: str, *, seed=1) -> str:
    """model_optimized.onnx (NCHW, logits) + tag_mapping.json."""
    import onnx  # lazy: a test dependency, not the toolkit's

    os.makedirs(folder, exist_ok=True)
    mapping = {str(i): {"tag": t, "category": c} for i, (t, c, _) in enumerate(MAPPING)}
    with open(os.path.join(folder, "tag_mapping.json"), "w", encoding="utf-8") as f:
        json.dump(mapping, f)
    model = _graph(len(MAPPING), [b for _, _, b in MAPPING], nchw=True, sigmoid=False,
                   batch="N", seed=seed)
    onnx.save(model, os.path.join(folder, "model_optimized.onnx"))
    return folder


def make_images(folder: str) -> tuple[list[str], str]:
    """Images covering every preprocessing path, as sd-scripts' sorted glob lists them:
    RGB smaller than 448 (Lanczos), RGBA with binary alpha at 448 (no resize), 2x2-block RGB at
    896 x 640 (area, exact), a palette image with a transparent index, and one in a subfolder."""
    rng = np.random.default_rng(7)
    os.makedirs(os.path.join(folder, "sub"), exist_ok=True)
    paths = []

    def save(name, img):
        path = os.path.join(folder, name)
        img.save(path)
        paths.append(path)

    save("a.png", Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)))
    rgba = rng.integers(0, 256, (300, 448, 4), dtype=np.uint8)
    rgba[..., 3] = np.where(rng.random((300, 448)) < 0.3, 0, 255)
    save("b.png", Image.fromarray(rgba, "RGBA"))
    blocks = rng.integers(0, 256, (320, 448, 3), dtype=np.uint8)
    save("C.PNG", Image.fromarray(blocks.repeat(2, axis=0).repeat(2, axis=1)))
    pal = Image.fromarray(rng.integers(0, 16, (120, 90), dtype=np.uint8), "P")
    pal.putpalette(list(rng.integers(0, 256, 16 * 3, dtype=np.uint8)) + [0] * (256 - 16) * 3)
    pal.info["transparency"] = 3
    save("d.png", pal)
    save(os.path.join("sub", "e.png"),
         Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    return sorted(paths[:4], key=lambda p: os.path.basename(p)), paths[4]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write a tiny WD tagger (for tests and benchmarks).")
    p.add_argument("out_dir", help="folder to write the model and its tag file into")
    p.add_argument("--layout", choices=("smilingwolf", "tag_mapping"), default="smilingwolf")
    p.add_argument("--batch", type=int, default=None,
                   help="a fixed batch dimension (default: dynamic); smilingwolf layout")
    args = p.parse_args(argv)
    if args.layout == "smilingwolf":
        build_smilingwolf(args.out_dir, batch=args.batch or "N")
    else:
        build_tag_mapping(args.out_dir)
    print(f"wrote a tiny {args.layout} tagger to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
