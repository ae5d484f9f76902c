"""Renders the attention layouts of bstrain.layout as one PNG for the docs.

    PYTHONPATH=$PWD python scripts/bench/render_layouts.py [--out benchmarks/attention_layouts.png]

S=2048, block 64 (32 x 32 blocks): causal, local (window 256), strided (stride 256), fixed (stride
256, summary 32), Longformer (window 128, 64 global tokens), BigBird (1 window block, 1 global, 2
random). Live blocks are white; partial blocks (a mask_callback applies) light grey.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bstrain import layout as L  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/attention_layouts.png")
    args = ap.parse_args()
    from PIL import Image, ImageDraw
    S, bs, n = 2048, 64, 32
    masks = {"causal": L.causal_mask, "local": L.local_mask(256), "strided": L.strided_mask(256),
             "fixed": L.fixed_mask(256, 32), "longformer": L.longformer_mask(128, 64),
             "bigbird": L.bigbird_mask(bs, 1, 1, 2, n, n, seed=0)}
    scale, gap, top = 6, 16, 18
    img = Image.new("L", (len(masks) * (n * scale + gap) + gap, n * scale + top + gap), 40)
    draw = ImageDraw.Draw(img)
    for col, (name, mask) in enumerate(masks.items()):
        lay, cb = L.attention_layout(mask, S, S, bs)
        tile = L.layout_image(lay, scale=scale).astype(np.uint8)
        if cb is not None:                          # partial blocks in light grey
            for i, j in zip(*np.nonzero(lay)):
                if not cb((bs, bs), 0, int(i), int(j), 0).all():
                    tile[i * scale:(i + 1) * scale, j * scale:(j + 1) * scale] = 170
        x = gap + col * (n * scale + gap)
        img.paste(Image.fromarray(tile), (x, top))
        draw.text((x, 3), f"{name} {lay.mean():.2f}", fill=255)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    img.save(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
