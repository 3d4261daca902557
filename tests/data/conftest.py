"""A small labelled image set for the data tests: 8x8 "digits" written by ``datasets``.

No package installed here ships a labelled image data set (scikit-learn and torchvision are not
dependencies), so the tests draw their own: ten fixed glyph bitmaps, each example one glyph with
seeded pixel noise, saved as a parquet with an ``Image`` column as ``datasets`` writes it.
"""

import datasets
import numpy as np
import PIL.Image
import pytest

GLYPHS = [  # 8x8, one string per row; "#" is ink
    ["..####..", ".#....#.", ".#....#.", ".#....#.", ".#....#.", ".#....#.", "..####..", "........"],
    ["...##...", "..###...", "...##...", "...##...", "...##...", "...##...", "..####..", "........"],
    ["..####..", ".#....#.", "......#.", ".....#..", "...##...", "..#.....", ".######.", "........"],
    ["..####..", ".#....#.", "......#.", "...###..", "......#.", ".#....#.", "..####..", "........"],
    [".....#..", "....##..", "...#.#..", "..#..#..", ".######.", ".....#..", ".....#..", "........"],
    [".######.", ".#......", ".#####..", "......#.", "......#.", ".#....#.", "..####..", "........"],
    ["..####..", ".#......", ".#......", ".#####..", ".#....#.", ".#....#.", "..####..", "........"],
    [".######.", "......#.", ".....#..", "....#...", "...#....", "...#....", "...#....", "........"],
    ["..####..", ".#....#.", ".#....#.", "..####..", ".#....#.", ".#....#.", "..####..", "........"],
    ["..####..", ".#....#.", ".#....#.", "..#####.", "......#.", "......#.", "..####..", "........"],
]


def digit_pixels(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 [n, 8, 8] images, int64 [n] labels): glyph ``i % 10`` with seeded noise, so no
    two examples are alike."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 10
    ink = np.array([[[c == "#" for c in row] for row in g] for g in GLYPHS], np.uint8) * 200
    images = ink[labels] + rng.integers(0, 56, (n, 8, 8), dtype=np.uint8)
    return images, labels


def write_digits(path, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A parquet of ``image`` (datasets.Image) and ``label`` (int64); returns its pixels and labels."""
    images, labels = digit_pixels(n, seed)
    ds = datasets.Dataset.from_dict(
        {"image": [PIL.Image.fromarray(im) for im in images], "label": labels.tolist()},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    ds.to_parquet(str(path))
    return images, labels


@pytest.fixture
def digits(tmp_path):
    """(parquet path, uint8 images [50, 8, 8], labels [50]) of 50 digits."""
    path = tmp_path / "digits.parquet"
    images, labels = write_digits(path, 50)
    return str(path), images, labels
