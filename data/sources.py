"""Data sources: a ``--data`` spec to a ``datasets.Dataset``.

Spec syntax, tried in this order:

- ``stdlib``: the embedded corpus (the Python standard library's source files; no download).
- ``hub:NAME[:CONFIG][@SPLIT]``: a Hugging Face Hub dataset via ``datasets.load_dataset``
  (split defaults to ``train``), e.g. ``hub:wikitext:wikitext-2-raw-v1@validation``.
- a local file, a directory (every data file under it, recursively, sorted) or a glob
  (``data/*.jsonl``). Formats by extension: text (``.txt``, ``.text``, ``.md``: one document per
  file), ``.jsonl``/``.json``, ``.parquet``, ``.csv``. One format per spec.
- anything else that does not look like a path (no data-file extension, not starting with
  ``/``, ``.`` or ``~``) is taken as a Hub name, ``NAME[:CONFIG][@SPLIT]`` without the prefix.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import glob
import io
import json
import os
import stat
import threading
from urllib.parse import urlparse

import datasets

from shardzoo.data.corpus import stdlib_corpus
from shardzoo.data.errors import DataError

STDLIB = "stdlib"
HUB_PREFIX = "hub:"
FORMATS = {  # extension -> datasets' packaged builder
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


def parse_hub_spec(spec: str) -> tuple[str, str | None, str]:
    """``[hub:]NAME[:CONFIG][@SPLIT]`` -> (name, config or None, split)."""
    rest = spec[len(HUB_PREFIX) :] if spec.startswith(HUB_PREFIX) else spec
    rest, _, split = rest.partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise DataError(f"data spec {spec!r}: no dataset name; expected hub:NAME[:CONFIG][@SPLIT]")
    return name, config or None, split or "train"


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or os.path.splitext(spec)[1].lower() in FORMATS


def local_files(spec: str) -> list[str] | None:
    """The data files a local spec names, sorted; None when the spec is not a local path."""
    path = os.path.expanduser(spec)
    if glob.has_magic(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data glob {spec!r} matches no files")
        return files
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [
                os.path.join(root, n)
                for n in names
                if not n.startswith(".") and os.path.splitext(n)[1].lower() in FORMATS
            ]
        if not files:
            raise DataError(f"data directory {spec!r} holds no data files ({', '.join(FORMATS)})")
        return sorted(files)
    if os.path.isfile(path):
        return [path]
    if os.path.exists(path):  # /dev/null, a pipe, a socket: there, but no file to read
        raise DataError(f"data {spec!r} is {_file_kind(path)}, not a data file: give a file, "
                        f"a directory or a glob of them")
    if _looks_like_path(spec):
        raise DataError(f"data file {spec!r} does not exist")
    return None


def _file_kind(path: str) -> str:
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _load_local(spec: str, files: list[str], cache_dir: str | None) -> datasets.Dataset:
    kinds = {os.path.splitext(f)[1].lower() for f in files}
    unknown = sorted(k or "(none)" for k in kinds if k not in FORMATS)
    if unknown:
        raise DataError(
            f"data {spec!r}: unsupported file extension {', '.join(unknown)}; "
            f"supported: {', '.join(FORMATS)}"
        )
    builders = {FORMATS[k] for k in kinds}
    if len(builders) > 1:
        raise DataError(
            f"data {spec!r} mixes formats ({', '.join(sorted(builders))}); give one format"
        )
    (builder,) = builders
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"data {spec!r}: empty dataset (every file is empty: {', '.join(files)})")
    if builder == "json":  # pyarrow's JSON reader takes bytes that are not UTF-8 and fails on first use
        for path in files:
            problem = _utf8_problem(path)
            if problem:
                raise DataError(f"data {spec!r}: {problem}")
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        with _quiet_datasets():
            return datasets.load_dataset(
                builder, data_files=files, split="train", cache_dir=cache_dir, **options
            )
    except Exception as e:  # noqa: BLE001 - a parse error is the user's file
        where = diagnose(builder, files)
        if where:
            raise DataError(f"data {spec!r}: {where}") from None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"data {spec!r}: cannot read {builder} file(s) {', '.join(files)}: {reason}"
        ) from None


@contextlib.contextmanager
def _quiet_datasets():
    """No log lines from ``datasets`` while loading: its errors come back in one DataError."""
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def diagnose(builder: str, files: list[str]) -> str | None:
    """The first file and place that ``datasets`` cannot read: unreadable, not UTF-8 (byte
    offset and line), a malformed JSON line or a CSV row of the wrong width (line)."""
    for path in files:
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            return f"cannot read {path}: {e.strerror}"
        if builder == "parquet":
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return _utf8_problem(path)
        problem = _json_problem(text) if builder == "json" else _csv_problem(text) if builder == "csv" else None
        if problem:
            return f"{path}, {problem}"
    return None


def _utf8_problem(path: str) -> str | None:
    """Where ``path`` stops being UTF-8 (the byte, its offset and line), read in 1 MiB chunks;
    None when it is UTF-8 throughout."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                bad = offset - pending + e.start
                f.seek(0)
                head = f.read(bad + 1)
                line = head.count(b"\n", 0, bad) + 1
                return (f"{path} is not UTF-8 text: byte 0x{head[bad]:02x} at byte offset {bad} "
                        f"(line {line}); convert the file to UTF-8")
            if not chunk:
                return None
            offset += len(chunk)


def _json_problem(text: str) -> str | None:
    try:
        json.loads(text)  # one JSON document (an array of rows, or an object)
        return None
    except ValueError:
        pass
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {n}: not valid JSON ({e.msg} at column {e.colno})"
        if not isinstance(row, dict):
            return f"line {n}: a JSON {type(row).__name__}, not an object of columns"
    return None


def _csv_problem(text: str) -> str | None:
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader, None)
        for row in reader:
            if row and header is not None and len(row) != len(header):
                return (f"line {reader.line_num}: {len(row)} fields where the header has "
                        f"{len(header)}")
    except csv.Error as e:
        return f"line {reader.line_num}: not valid CSV ({e})"
    return None


HUB_PROBE_S = 3.0  # how long a Hub spec waits to learn whether the Hub can be reached


def hub_reachable(timeout: float = HUB_PROBE_S) -> bool:
    """Whether the Hub endpoint accepts a TCP connection within ``timeout`` seconds (name lookup
    included, which has no timeout of its own: it runs in a thread we stop waiting for)."""
    import socket

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    result = []

    def probe():
        try:
            socket.create_connection((url.hostname, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


@contextlib.contextmanager
def _offline():
    """The Hub libraries in offline mode: a cached dataset loads, anything else fails at once."""
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _load_hub(spec: str, cache_dir: str | None) -> datasets.Dataset:
    name, config, split = parse_hub_spec(spec)
    unreachable = not datasets.config.HF_HUB_OFFLINE and not hub_reachable()
    try:  # without a network, only the cache is tried: no retries for half a minute
        with _offline() if unreachable else contextlib.nullcontext(), _quiet_datasets():
            ds = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - the name, the network or the cache: all the user's
        flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
        offline = next((v for v in flags if os.environ.get(v, "0") not in ("", "0")), None)
        hint = f" (offline: {offline}={os.environ[offline]})" if offline else ""
        if unreachable:
            from huggingface_hub import constants

            hint = f" (the Hub at {constants.ENDPOINT} cannot be reached and it is not in the cache)"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"data {spec!r} is not a local file, directory or glob, and Hub dataset {name!r} "
            f"cannot be loaded{hint}: {reason}"
        ) from None
    if isinstance(ds, datasets.DatasetDict):  # only when no split was given; we always give one
        raise DataError(f"data {spec!r}: choose a split with @SPLIT ({', '.join(ds)})")
    return ds


def load_source(spec: str, cache_dir: str | None = None) -> datasets.Dataset:
    """The ``datasets.Dataset`` a ``--data`` spec names (see the module docstring)."""
    spec = str(spec).strip()
    if spec == STDLIB:
        ds = stdlib_corpus()
    elif spec.startswith(HUB_PREFIX):
        ds = _load_hub(spec, cache_dir)
    else:
        files = local_files(spec)
        ds = _load_hub(spec, cache_dir) if files is None else _load_local(spec, files, cache_dir)
    if len(ds) == 0:
        raise DataError(f"data {spec!r}: empty dataset (0 rows)")
    return ds


def check_text_column(
    ds: datasets.Dataset, column: str, spec: str, flag: str = "--text-column"
) -> None:
    """A clear error when ``column`` is missing from ``ds`` or does not hold text."""
    if column not in ds.column_names:
        raise DataError(
            f"data {spec!r} has no column {column!r} ({flag}); its columns are: "
            f"{', '.join(ds.column_names)}"
        )
    feature = ds.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"column {column!r} of data {spec!r} holds {feature}, not text ({flag})")


def without_missing(ds: datasets.Dataset, columns, spec: str, skip: bool) -> datasets.Dataset:
    """``ds`` when no row lacks a value (null) in ``columns``; else, with ``skip``, ``ds`` without
    those rows (their count said in one warning line), or a DataError naming the first such row
    and column. A missing value is never trained on as an empty text."""
    import sys

    import pyarrow.compute as pc

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    missing = None
    for column in columns:
        nulls = pc.is_null(table.column(column))
        missing = nulls if missing is None else pc.or_(missing, nulls)
    count = 0 if missing is None else int(pc.sum(missing).as_py() or 0)
    if not count:
        return ds
    if not skip:
        first = int(pc.index(missing, True).as_py())
        column = next(c for c in columns if ds[first][c] is None)
        raise DataError(f"data {spec!r}: row {first + 1} has no value in column {column!r} (null; {count} of "
                        f"{len(ds)} rows lack one): fill or drop those rows, or pass --skip-missing to skip them")
    keep = [i for i, m in enumerate(missing.to_pylist()) if not m]
    sys.stderr.write(f"shardzoo: warning: data {spec!r}: skipped {count} of {len(ds)} rows with no value in "
                     f"{', '.join(repr(c) for c in columns)} (--skip-missing)\n")
    return ds.select(keep)
