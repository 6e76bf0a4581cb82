"""The tiny VL demo's data, drawn at run time (no binary files in the repository): small PNGs of coloured shapes
and questions about them, as a LLaMA-Factory multimodal sharegpt file (``messages`` + ``images``, paths relative
to the file). Mixed in: rows with two images and text-only rows (docs/vl.md)."""

from __future__ import annotations

import json
import os

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((56, 56), (84, 56), (56, 112), (112, 84))
"""(width, height): with the tiny processor (28-pixel tokens, 4 to 16 tokens per image) 4, 6, 8 and 12 tokens."""


def draw(shape: str, colour: str, size: tuple[int, int]):
    """A white PIL image of ``size`` with one ``shape`` in ``colour`` filling most of it."""
    from PIL import Image, ImageDraw

    width, height = size
    image = Image.new("RGB", size, (255, 255, 255))
    pen = ImageDraw.Draw(image)
    box = (width // 8, height // 8, width - width // 8, height - height // 8)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    return image


def make_shapes_dataset(out_dir: str, *, num_rows: int = 48) -> str:
    """Write ``out_dir/images/*.png`` and ``out_dir/shapes.json``; returns the json path."""
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    combos = [(s, c) for s in SHAPES for c in COLOURS]
    rows = []
    for i in range(num_rows):
        shape, colour = combos[i % len(combos)]
        name = f"images/{i:03d}_{colour}_{shape}.png"
        draw(shape, colour, SIZES[i % len(SIZES)]).save(os.path.join(out_dir, name))
        if i % 8 == 7:  # two images in one row
            other_shape, other_colour = combos[(i * 5 + 3) % len(combos)]
            other = f"images/{i:03d}b_{other_colour}_{other_shape}.png"
            draw(other_shape, other_colour, SIZES[(i + 1) % len(SIZES)]).save(os.path.join(out_dir, other))
            rows.append({"messages": [
                {"role": "user", "content": "<image><image>What are the two shapes?"},
                {"role": "assistant", "content": f"A {colour} {shape} and a {other_colour} {other_shape}."}],
                "images": [name, other]})
        elif i % 8 == 3:  # text only, in the same file
            rows.append({"messages": [{"role": "user", "content": f"Name a {colour} thing."},
                                      {"role": "assistant", "content": f"A {colour} {shape}."}], "images": []})
        else:
            question = "What colour is the shape?" if i % 2 else "What shape is this?"
            answer = f"It is {colour}." if i % 2 else f"A {colour} {shape}."
            rows.append({"messages": [{"role": "user", "content": f"<image>{question}"},
                                      {"role": "assistant", "content": answer}], "images": [name]})
    path = os.path.join(out_dir, "shapes.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(rows, handle, indent=1)
    return path
