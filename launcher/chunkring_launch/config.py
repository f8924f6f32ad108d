"""Job configurations: a preset name from ``configs/`` (the package's ``configs`` link) or a path to a TOML
file, checked field by field."""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources
from pathlib import Path

from chunkring.errors import ChunkringUsageError

__all__ = ["from_table", "load_table", "parse_overrides"]


def load_table(name_or_path: str) -> dict:
    """Read a preset (``"bringup"``) or a ``.toml`` path into a dict."""
    path = Path(name_or_path)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ChunkringUsageError(f"no such config file: {path}", field="config")
        text = path.read_text()
    else:
        presets = resources.files("chunkring_launch") / "configs"
        preset = presets / f"{name_or_path}.toml"
        if not preset.is_file():
            known = sorted(p.name[:-5] for p in presets.iterdir()
                           if p.name.endswith(".toml"))
            raise ChunkringUsageError(f"unknown preset {name_or_path!r}; presets: {known}", field="config")
        text = preset.read_text()
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ChunkringUsageError(f"{name_or_path}: {exc}", field="config") from None


def from_table(cls, table: dict, *, job: str):
    """Build the frozen dataclass ``cls`` from ``table``; unknown keys and wrong types are errors."""
    table = dict(table)
    if table.pop("job", job) != job:
        raise ChunkringUsageError(f"config is for job {table.get('job')!r}, not {job!r}", field="job")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ChunkringUsageError(f"unknown keys {unknown} for job {job}; known: {sorted(fields)}", field="config")
    for key, value in table.items():
        expected = fields[key].type
        expected = {"int": int, "float": float, "str": str, "bool": bool}.get(expected, expected)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            table[key] = value = float(value)  # duration_s=600 means 600.0
        if isinstance(expected, type) and not (isinstance(value, expected)
                                               and not (expected is int and isinstance(value, bool))):
            raise ChunkringUsageError(f"expected {expected.__name__}, got {value!r}", field=key)
    return cls(**table)


def parse_overrides(items) -> dict:
    """``["rounds=32", "name=x"]`` -> ``{"rounds": 32, "name": "x"}``, values read as TOML values
    (ints, floats, booleans, quoted strings) with bare words taken as strings. Types are checked later,
    by :func:`from_table`, against the job's config."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ChunkringUsageError(f"expected key=value, got {item!r}", field="overrides")
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw
    return out
