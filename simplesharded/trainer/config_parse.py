"""Parsing a training config: TOML tables and command-line words into a tree of section
dataclasses (config.py's ``Config``), strictly.

Invariant: every value enters the tree through ``set_key``, which finds the key's field (an
unknown key is a ValueError naming it and the closest valid key) and coerces the value to the
field's type (a wrong type is a ValueError naming the key). Only the structure of the tree is
known here, passed in as ``schema`` (a dataclass whose fields are section dataclasses), so
config.py can build its schema on this module without an import back. The one key known by
name is the deprecated ``parallelism.flat_buckets``, read as ``parallelism.storage``.
"""

import dataclasses
import difflib
import os
import sys
from typing import Any, Iterable

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, packaged, before Python 3.11
    import tomli as tomllib


# ---------------------------------------------------------------------------- key lookup

def sections(schema: type) -> dict[str, type]:
    """Section name → its dataclass, in declaration order."""
    return {f.name: f.default_factory for f in dataclasses.fields(schema)}


def all_keys(schema: type) -> list[str]:
    """Every valid `section.key`, in declaration order."""
    return [f"{s}.{f.name}" for s, cls in sections(schema).items()
            for f in dataclasses.fields(cls)]


def _suggest(schema: type, key: str) -> str:
    keys = all_keys(schema)
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:  # e.g. `steps` at top level, or a section typo far from the real one
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[1]: k for k in reversed(keys)}
        close = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=1)]
    return f"; did you mean {close[0]!r}?" if close else ""


def _field(schema: type, key: str, source: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    cls = sections(schema).get(section)
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
    if name not in fields:
        raise ValueError(f"unknown config key {key!r} ({source}){_suggest(schema, key)}")
    return fields[name]


def flatten(schema: type, data: dict[str, Any], source: str) -> Iterable[tuple[str, Any]]:
    """{section: {key: value}} (as TOML parses it) → (`section.key`, value) in order."""
    for section, body in data.items():
        if not isinstance(body, dict):
            if section in sections(schema):
                raise ValueError(f"{section} must be a table ([{section}]) ({source})")
            _field(schema, section, source)  # a bare top-level key is always unknown: raises
        for name, value in body.items():
            yield f"{section}.{name}", value


# ---------------------------------------------------------------------------- value coercion

_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _coerce(key: str, typ: type, value: Any, from_cli: bool) -> Any:
    def bad():
        return ValueError(f"{key} expects {type_name(typ)}, got {value!r} "
                          f"({type(value).__name__})")

    if typ == list[int]:
        if from_cli and isinstance(value, str):  # "8,16,32" or "[8, 16, 32]"
            body = value.strip().removeprefix("[").removesuffix("]")
            try:
                return [int(v) for v in body.split(",") if v.strip()]
            except ValueError:
                raise bad() from None
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value):
            return list(value)
        raise bad()
    if from_cli and isinstance(value, str):  # CLI values are strings: parse by field type
        if typ is bool:
            if value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            raise bad()
        if typ in (int, float):
            try:
                return typ(value)
            except ValueError:
                raise bad() from None
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, typ):
        return value
    raise bad()


def type_name(typ) -> str:
    """A field type as errors and --help name it."""
    return "list of int" if typ == list[int] else typ.__name__


def set_key(cfg: Any, key: str, value: Any, source: str, from_cli: bool) -> None:
    """Set `section.key` of the tree `cfg` to `value`, coerced to the field's type."""
    if key == FLAT_BUCKETS_KEY:
        key, value = "parallelism.storage", _storage_of_flat_buckets(value, from_cli)
    f = _field(type(cfg), key, source)
    section = getattr(cfg, key.partition(".")[0])
    setattr(section, f.name, _coerce(key, f.type, value, from_cli))


# parallelism.storage's name until flat storage was retired: still read, with one line
# naming the new key. A TOML boolean or a bare command-line flag as before.
FLAT_BUCKETS_KEY = "parallelism.flat_buckets"
# Set by run_train.sh for the ranks it starts: its preflight (--check-only) read the same
# config and printed its warnings already.
PREFLIGHT_DONE = "SIMPLESHARDED_PREFLIGHT_DONE"
_STORAGE_OF_FLAT_BUCKETS = {"false": "param", "ragged": "ragged", "auto": "auto"}


def _storage_of_flat_buckets(value: Any, from_cli: bool) -> str:
    """parallelism.storage's value for a value of the deprecated parallelism.flat_buckets."""
    word = str(value).lower()
    if isinstance(value, bool) or (from_cli and word in _TRUE + _FALSE):
        word = "true" if word in _TRUE else "false"
    if word == "true":
        raise ValueError("parallelism.flat_buckets=true: flat storage is retired; use "
                         "--parallelism.storage ragged (zero-copy buckets, docs/zero_copy.md)")
    if not isinstance(value, (bool, str)) or word not in _STORAGE_OF_FLAT_BUCKETS:
        raise ValueError(f"parallelism.flat_buckets={value!r} is not one of "
                         f"{sorted(_STORAGE_OF_FLAT_BUCKETS)} (deprecated: use "
                         f"parallelism.storage)")
    storage = _STORAGE_OF_FLAT_BUCKETS[word]
    # once per job: not once per rank, nor again after run_train.sh's preflight printed it
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(PREFLIGHT_DONE):
        print(f"[simplesharded] parallelism.flat_buckets is deprecated: use "
              f"--parallelism.storage {storage}", file=sys.stderr, flush=True)
    return storage


# ---------------------------------------------------------------------------- command line

def _flag(schema: type, key: str, following: str | None) -> bool | None:
    """None: ``--key`` is not a flag (it needs a value). Else whether it takes ``following``
    (the next argument) as its value: a bool word (``--flag true``), or any value of a
    switch (its choice, checked later); otherwise the bare flag means True."""
    switch = key == FLAT_BUCKETS_KEY  # a choice of words, or a bare flag (true)
    if not switch and _field(schema, key, "command line").type is not bool:
        return None
    if following is None:
        return False
    return following.lower() in _TRUE + _FALSE or (switch and not following.startswith("--"))


def parse_cli(argv: list[str], schema: type) -> list[tuple[str, Any]]:
    """`--s.k v`, `--s.k=v`, bare `--s.k` / `--no-s.k` for bools → [(key, value)] in order.

    Values stay strings (bools from bare flags are real bools); set_key coerces them.
    """
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected command-line argument {arg!r}; expected --section.key")
        body = arg[2:]
        if body.startswith("no-"):
            key = body[3:]
            if "=" in key or _flag(schema, key, None) is None:
                raise ValueError(f"{arg!r}: --no- applies only to a bool key without a value")
            out.append((key, False))
            continue
        key, eq, value = body.partition("=")
        if eq:
            out.append((key, value))
        elif _flag(schema, key, None) is not None:
            if _flag(schema, key, argv[i] if i < len(argv) else None):
                out.append((key, argv[i]))
                i += 1
            else:
                out.append((key, True))
        elif i < len(argv) and not argv[i].startswith("--"):
            out.append((key, argv[i]))
            i += 1
        else:
            raise ValueError(f"{arg!r} expects a value")
    return out


# ---------------------------------------------------------------------------- loading

def read(schema: type, path: str | None, argv: list[str]) -> tuple[Any, set[str]]:
    """(a `schema` tree of defaults < TOML at `path` (or `--job.config_file` in argv, which
    wins) < argv overrides, the keys set explicitly). No value checks beyond types."""
    overrides = parse_cli(argv, schema)
    for key, value in overrides:
        if key == "job.config_file":
            path = value
    cfg, explicit = schema(), set()
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ValueError(f"job.config_file={path!r} cannot be read: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"job.config_file={path!r} is not valid TOML: {e}") from None
        for key, value in flatten(schema, data, f"in {path}"):
            set_key(cfg, key, value, f"in {path}", from_cli=False)
            explicit.add(key)
    for key, value in overrides:
        set_key(cfg, key, value, "on the command line", from_cli=True)
        explicit.add(key)
    if {FLAT_BUCKETS_KEY, "parallelism.storage"} <= explicit:
        raise ValueError("parallelism.flat_buckets and parallelism.storage are both set: "
                         "flat_buckets is storage's deprecated name, keep storage only")
    cfg.job.config_file = path or ""
    return cfg, explicit
