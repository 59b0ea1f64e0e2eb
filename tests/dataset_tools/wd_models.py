"""An independent preprocessing (numpy / PIL) of the WD tagger's input and the raw onnxruntime
scores; the tiny taggers and the test images come from tools/make_tiny_tagger.py."""
from __future__ import annotations


import numpy as np
from PIL import Image

from tools.make_tiny_tagger import (CHARACTERS, GENERAL, MAPPING, RATINGS, SIZE,  # noqa: F401
                                    build_smilingwolf, build_tag_mapping, make_images)


def reference_input(path: str, size: int = SIZE) -> np.ndarray:
    """The model input computed here without the tool: alpha over white by formula, BGR, white
    square, area average by block means (whole factors) or PIL's Lanczos (smaller images)."""
    im = Image.open(path)
    im.load()
    rgba = np.asarray(im.convert("RGBA"), dtype=np.float64)
    alpha = rgba[..., 3:] / 255.0
    rgb = np.rint(rgba[..., :3] * alpha + 255.0 * (1 - alpha))
    bgr = rgb[..., ::-1]
    side = max(bgr.shape[:2])
    canvas = np.full((side, side, 3), 255.0)
    top, left = (side - bgr.shape[0]) // 2, (side - bgr.shape[1]) // 2
    canvas[top:top + bgr.shape[0], left:left + bgr.shape[1]] = bgr
    if side > size:
        assert side % size == 0, "the reference takes whole area factors only"
        f = side // size
        canvas = canvas.reshape(size, f, size, f, 3).mean(axis=(1, 3))
    elif side < size:
        rgb_sq = Image.fromarray(canvas[..., ::-1].astype(np.uint8))
        canvas = np.asarray(rgb_sq.resize((size, size), Image.LANCZOS), np.float64)[..., ::-1]
    return canvas.astype(np.float32)


def onnx_scores(model_path: str, batch: np.ndarray, nchw: bool = False) -> np.ndarray:
    """The model's raw output for NHWC BGR 0..255 images, run with onnxruntime directly."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    x = batch.transpose(0, 3, 1, 2) / 127.5 - 1.0 if nchw else batch
    return sess.run(None, {sess.get_inputs()[0].name: x.astype(np.float32)})[0]
