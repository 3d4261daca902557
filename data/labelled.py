"""Labelled examples: feature columns and a label column of a ``datasets.Dataset`` as arrays.

Features (each row's features concatenated in column order, float32):

- a numeric scalar column: one feature;
- a fixed-length numeric list or array column (``List``, nested lists, ``Array2D``/``Array3D``):
  flattened, e.g. ``[H, W]`` or ``[H, W, C]`` pixels;
- an image column (``datasets.Image``, or a ``{bytes, path}`` struct as ``datasets`` writes
  images): decoded and flattened; every image must have the same shape.

uint8 values of list, array and image columns (pixels) are divided by 255; nothing else is scaled.

Labels: integer class ids (``ClassLabel`` or any integer column; bool is 0/1) or strings (mapped
to ids in sorted order) make a classification task; floats or fixed-length lists of numbers a
regression task.
"""

from __future__ import annotations

import dataclasses

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardzoo.data.errors import DataError
from shardzoo.sharding import axes as ax

CLASSIFICATION, REGRESSION = "classification", "regression"


@dataclasses.dataclass(frozen=True)
class LabelledRows:
    """Examples as arrays: rows for ``BatchIterator`` (``len``, ``shapes``, ``axes``, ``batch``)."""

    features: np.ndarray  # [rows, features] float32
    targets: np.ndarray  # [rows] int32 (classification) | [rows, outputs] float32 (regression)
    num_classes: int | None  # classification: number of classes; regression: None
    label_names: tuple[str, ...] | None  # class names (string or ClassLabel labels), else None

    def __len__(self) -> int:
        return len(self.features)

    @property
    def task(self) -> str:
        return REGRESSION if self.num_classes is None else CLASSIFICATION

    @property
    def num_features(self) -> int:
        return self.features.shape[1]

    @property
    def num_outputs(self) -> int:
        """What the model must output per example: one logit per class, or the target width."""
        return self.targets.shape[1] if self.num_classes is None else self.num_classes

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {"inputs": (self.num_features,), "targets": self.targets.shape[1:], "weights": ()}

    @property
    def axes(self) -> dict[str, tuple[str | None, ...]]:
        return {k: (ax.BATCH,) + (None,) * len(s) for k, s in self.shapes.items()}

    def select(self, indices) -> LabelledRows:
        indices = np.asarray(indices, np.int64)
        return dataclasses.replace(
            self, features=self.features[indices], targets=self.targets[indices]
        )

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The batch of the examples at ``indices``; -1 is a fill-up row (zeros, weight 0)."""
        real = indices >= 0
        picked = np.maximum(indices, 0)
        fill = real.reshape(-1, *([1] * (self.targets.ndim - 1)))
        return {
            "inputs": np.where(real[:, None], self.features[picked], 0).astype(np.float32),
            "targets": np.where(fill, self.targets[picked], 0).astype(self.targets.dtype),
            "weights": real.astype(np.float32),
        }


@dataclasses.dataclass(frozen=True)
class RawLabels:
    """A label column before ids are assigned: class ids, class names, or regression targets."""

    kind: str  # "ids" | "names" | "values"
    values: np.ndarray  # [rows] int64 | [rows] str | [rows, outputs] float32
    names: tuple[str, ...] | None = None  # a ClassLabel's names


def _where(spec: str, column: str) -> str:
    return f"column {column!r} of data {spec!r}"


def check_columns(ds, spec: str, label_column: str, feature_columns) -> tuple[str, ...]:
    """The feature columns (default: every column but the label), each checked to exist."""
    names = ds.column_names
    for column, flag in [(label_column, "--label-column")] + [
        (c, "--feature-columns") for c in feature_columns or ()
    ]:
        if column not in names:
            raise DataError(
                f"data {spec!r} has no column {column!r} ({flag}); its columns are: "
                f"{', '.join(names)}"
            )
    if feature_columns is None:
        feature_columns = [c for c in names if c != label_column]
    if not feature_columns:
        raise DataError(
            f"data {spec!r} has no feature columns besides the label {label_column!r} "
            f"(its columns are: {', '.join(names)})"
        )
    if label_column in feature_columns:
        raise DataError(f"column {label_column!r} of data {spec!r} is both the label and a feature")
    return tuple(feature_columns)


def _missing(array: pa.Array) -> np.ndarray:
    """Rows that are null or NaN."""
    missing = array.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_floating(array.type):
        missing |= pc.is_nan(array).fill_null(False).to_numpy(zero_copy_only=False)
    return missing


def _check_no_missing(array: pa.Array, where: str, hint: str = "") -> None:
    missing = np.flatnonzero(_missing(array))
    if len(missing):
        raise DataError(
            f"{where}: {len(missing)} of {len(array)} rows have no value (first: row "
            f"{missing[0]}){hint}"
        )


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_number(t: pa.DataType) -> bool:
    """A number, or a (nested) list of numbers."""
    if isinstance(t, pa.ExtensionType):
        t = t.storage_type
    while _is_list(t):
        t = t.value_type
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _numbers(array: pa.Array, where: str) -> tuple[np.ndarray, bool]:
    """A numeric scalar or fixed-length (nested) list column as [rows, values]; and whether it
    was a list of uint8 (pixels, to be scaled)."""
    if not _is_number(array.type):
        raise DataError(f"{where} holds {array.type}, not numbers")
    if isinstance(array.type, pa.ExtensionType):  # datasets' Array2D ... Array5D
        array = array.storage
    rows, values, nested = len(array), array, False
    while _is_list(values.type):
        _check_no_missing(values, where)
        lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            other = int(np.flatnonzero(lengths != lengths[0])[0])
            at = "row" if not nested else "nested list"
            raise DataError(
                f"{where}: lists of different lengths ({at} 0 has {lengths[0]} values, {at} "
                f"{other} has {lengths[other]}); a feature or label list must have a fixed length"
            )
        values, nested = pc.list_flatten(values), True
    _check_no_missing(values, where)
    flat = values.to_numpy(zero_copy_only=False)
    return flat.reshape(rows, -1), nested and flat.dtype == np.uint8


def _is_image(feature, array: pa.Array) -> bool:
    if isinstance(feature, datasets.Image):
        return True
    t = array.type
    return pa.types.is_struct(t) and {t.field(i).name for i in range(t.num_fields)} == {
        "bytes",
        "path",
    }


def _images(array: pa.Array, where: str) -> np.ndarray:
    """Decode an image column to [rows, pixels] (uint8 scaled to [0, 1])."""
    _check_no_missing(array, where)
    decoder = datasets.Image()
    pixels, first = [], None
    for row, cell in enumerate(array.to_pylist()):
        try:
            image = np.asarray(decoder.decode_example(cell))
        except Exception as e:  # noqa: BLE001 - a broken image is the user's file
            raise DataError(f"{where}: cannot decode the image of row {row}: {e}") from None
        if first is None:
            first = image
        elif image.shape != first.shape or image.dtype != first.dtype:
            raise DataError(
                f"{where}: images of different shapes (row 0: {list(first.shape)} {first.dtype}, "
                f"row {row}: {list(image.shape)} {image.dtype}); resize them to one shape"
            )
        pixels.append(image.reshape(-1))
    flat = np.stack(pixels)
    return flat / np.float32(255) if flat.dtype == np.uint8 else flat


def read_features(ds, table: pa.Table, spec: str, columns) -> np.ndarray:
    """The feature columns of ``ds`` (its arrow ``table``) as float32 [rows, features]."""
    parts = []
    for column in columns:
        where = _where(spec, column)
        array = table.column(column).combine_chunks()
        if _is_image(ds.features[column], array):
            parts.append(_images(array, where))
            continue
        values, pixels = _numbers(array, where)
        parts.append(values / np.float32(255) if pixels else values)
    return np.concatenate([p.astype(np.float32) for p in parts], axis=1)


def read_labels(ds, table: pa.Table, spec: str, column: str) -> RawLabels:
    """The label column: class ids, class names or regression targets (see the module doc)."""
    where = _where(spec, column)
    feature, array = ds.features[column], table.column(column).combine_chunks()
    kind = array.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        _check_no_missing(array, where)
        return RawLabels("names", np.asarray(array.to_pylist(), dtype=object))
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        _check_no_missing(array, where)
        ids = array.to_numpy(zero_copy_only=False).astype(np.int64)
        if (ids < 0).any():
            row = int(np.flatnonzero(ids < 0)[0])
            what = "no class (-1)" if isinstance(feature, datasets.ClassLabel) else ids[row]
            raise DataError(f"{where}: row {row} has label {what}; class ids must be 0 or more")
        names = tuple(feature.names) if isinstance(feature, datasets.ClassLabel) else None
        return RawLabels("ids", ids, names)
    if pa.types.is_floating(kind):
        missing = _missing(array)
        if missing.any():
            present = array.filter(pa.array(~missing)).to_numpy(zero_copy_only=False)
            integral = len(present) and np.array_equal(present, np.round(present))
            hint = (
                " (an integer label column with missing values reads as floats)" if integral else ""
            )
            _check_no_missing(array, where, hint)
    if not _is_number(kind):
        raise DataError(
            f"{where} holds {kind}: a label must be an integer class id, a string, a float or a "
            "fixed-length list of floats"
        )
    values, _ = _numbers(array, where)
    return RawLabels("values", values.astype(np.float32))


def encode_labels(
    labels: list[RawLabels], specs: list[str], column: str
) -> tuple[list[np.ndarray], int | None, tuple[str, ...] | None]:
    """Targets for each split (train first) from its raw labels, one id space for all splits:
    (targets per split, num_classes or None, label_names or None)."""
    kinds = {raw.kind for raw in labels}
    if len(kinds) > 1:
        found = ", ".join(f"{s!r}: {raw.kind}" for s, raw in zip(specs, labels, strict=True))
        raise DataError(f"label column {column!r} holds different kinds of labels ({found})")
    kind = kinds.pop()
    if kind == "values":
        widths = {raw.values.shape[1] for raw in labels}
        if len(widths) > 1:
            raise DataError(f"label column {column!r}: lists of different lengths across {specs}")
        return [raw.values for raw in labels], None, None
    if kind == "names":
        names = tuple(sorted(set().union(*(set(raw.values) for raw in labels))))
        lookup = {n: i for i, n in enumerate(names)}
        targets = [np.asarray([lookup[v] for v in raw.values], np.int32) for raw in labels]
        return targets, len(names), names
    names = labels[0].names
    num_classes = max(int(raw.values.max()) + 1 for raw in labels)
    if names is not None:
        if num_classes > len(names):
            raise DataError(
                f"label column {column!r}: class id {num_classes - 1} but only {len(names)} "
                f"class names ({', '.join(names)})"
            )
        num_classes = len(names)
    return [raw.values.astype(np.int32) for raw in labels], num_classes, names


def read_examples(ds, spec: str, label_column: str, feature_columns):
    """(feature columns, features [rows, features] float32, RawLabels) of a loaded dataset."""
    columns = check_columns(ds, spec, label_column, feature_columns)
    table = ds.with_format("arrow")[:].select([*columns, label_column])
    features = read_features(ds, table, spec, columns)
    return columns, features, read_labels(ds, table, spec, label_column)
