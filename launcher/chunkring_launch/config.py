"""Job configurations: a preset name from ``configs/`` (the package's ``configs`` link) or a path to a TOML
file, checked field by field."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from chunkring.errors import ChunkringUsageError, UsageProblems

__all__ = ["CheckedConfig", "check_range", "from_table", "job_config", "load_table", "parse_overrides"]

T = TypeVar("T")


def load_table(name_or_path: str) -> dict[str, Any]:
    """Read a preset (``"bringup"``) or a ``.toml`` path into a dict."""
    path = Path(name_or_path)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ChunkringUsageError(f"no such config file: {path}", field="config")
        source: Any = path
    else:
        presets = resources.files("chunkring_launch") / "configs"
        source = presets / f"{name_or_path}.toml"
        if not source.is_file():
            known = sorted(p.name[:-5] for p in presets.iterdir()
                           if p.name.endswith(".toml"))
            raise ChunkringUsageError(f"unknown preset {name_or_path!r}; presets: {known}", field="config")
    try:  # an unreadable file is bad usage (status 2), not a crash with a traceback
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChunkringUsageError(f"cannot read {name_or_path}: {exc}", field="config") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ChunkringUsageError(f"{name_or_path}: {exc}", field="config") from None


class CheckedConfig:
    """A job's config (a frozen dataclass deriving from this) that reports every bad value at once: each class
    adds its problems in :meth:`check`, calling ``super().check(problems)`` first, and building it raises one
    ``ChunkringUsageError`` listing them all (``field`` the first). Each problem names the key, its value and
    what it must be."""

    def __post_init__(self) -> None:
        problems = UsageProblems()
        self.check(problems)
        problems.raise_if_any()

    def check(self, problems: UsageProblems) -> None:
        """Add this config's problems to ``problems``; a key already found at fault keeps its first one."""


def check_range(problems: UsageProblems, config: object, name: str, low: float, high: float, why: str = "") -> bool:
    """Whether ``config.name`` is in [low, high] (:meth:`UsageProblems.check_range`)."""
    return problems.check_range(name, getattr(config, name), low, high, why)


def from_table(cls: type[T], table: Mapping[str, Any], *, job: str) -> T:
    """Build the frozen dataclass ``cls`` from ``table``; unknown keys, wrong types and bad values are errors,
    every one of them listed in one ``ChunkringUsageError``."""
    table = dict(table)
    problems = UsageProblems()
    named = table.pop("job", job)
    if named != job:
        problems.add(f"config is for job {named!r}, not {job!r}", field="job")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - set(fields))
    if unknown:
        problems.add(f"unknown keys {unknown} for job {job}; known: {sorted(fields)}", field="config")
    checked = {}
    for key, value in table.items():
        if key not in fields:
            continue
        declared = fields[key].type  # a string: the job modules use `from __future__ import annotations`
        expected = {"int": int, "float": float, "str": str, "bool": bool}.get(declared, declared) \
            if isinstance(declared, str) else declared
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # duration_s=600 means 600.0
        if isinstance(expected, type) and not (isinstance(value, expected)
                                               and not (expected is int and isinstance(value, bool))):
            problems.add(f"expected {expected.__name__}, got {value!r}", field=key)
        else:
            checked[key] = value
    # The keys of the right type are checked too (the others at their defaults), so one run lists every problem.
    with problems.collect():
        config = cls(**checked)
    problems.raise_if_any()
    return config


def job_config(cls: type[T], name_or_path: str, overrides: Iterable[str], *, job: str) -> T:
    """``job``'s config: the preset or file ``name_or_path`` with ``overrides`` (``key=value``) applied, checked
    against ``cls`` (:func:`load_table`, :func:`parse_overrides`, :func:`from_table`)."""
    return from_table(cls, {**load_table(name_or_path), **parse_overrides(overrides, cls)}, job=job)


def parse_overrides(items: Iterable[str], config: type | None = None) -> dict[str, Any]:
    """``["rounds=32", "name=x"]`` -> ``{"rounds": 32, "name": "x"}``, values read as TOML values
    (ints, floats, booleans, quoted strings) with bare words taken as strings. A key that ``config`` (the
    job's config class) declares ``str`` takes the text as written unless it is a quoted TOML string, so
    ``tokens=512`` is ``"512"``. Types are checked later, by :func:`from_table`, against the job's config."""
    # The shell strips quotes (`tokens="512"` arrives as tokens=512), so a str key cannot rely on them.
    text_keys = {f.name for f in dataclasses.fields(config) if f.type in ("str", str)} if config else set()
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ChunkringUsageError(f"expected key=value, got {item!r}", field="overrides")
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw
        if key in text_keys and not isinstance(out[key], str):
            out[key] = raw
    return out
