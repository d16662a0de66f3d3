"""Reading pipetrain's versioned JSON files (profiles, plans): each failure is one line that names the
file, what is wrong and the command that makes a good one."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def read_text(path: str | os.PathLike, kind: str, make: str, error: type[ValueError] = ValueError) -> str:
    """The text of a ``kind`` file ("profile", "plan"), or ``error``: one line naming the file and
    saying to make one with ``make``."""
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise error(f"{path}: no such {kind} file; make one with {make}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read it as text ({e}); make one with {make}") from None
    if not text.strip():
        raise error(f"{path}: the file is empty; make one with {make}")
    return text


def parse_json(text: str, source: str, make: str, error: type[ValueError] = ValueError) -> Any:
    """``json.loads(text)``, or ``error``: one line with the place and whether the text looks cut short
    (it opens an object or list and does not close one)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        opened, closed = text.lstrip()[:1] in ("{", "["), text.rstrip().endswith(("}", "]"))
        cut = " (truncated?)" if opened and not closed else ""
        raise error(f"{source}: not valid JSON{cut}: {e}; make one with {make}") from None


def check_header(data: Any, fmt: str, version: int, source: str, make: str,
                 error: type[ValueError] = ValueError) -> None:
    """Raise ``error`` (one line) unless ``data`` is an object of format ``fmt`` at ``version``."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise error(f"{source}: not a {fmt} version {version} file; make one with {make}")
    found = data.get("version")
    if isinstance(found, int) and found > version:
        raise error(f"{source}: written by a newer pipetrain ({fmt} version {found}; this one reads {version}); "
                    f"upgrade pipetrain or make it again with {make}")
    if found != version:
        raise error(f"{source}: not a {fmt} version {version} file (its version is {found!r}); make one with {make}")


def read_field(entry: dict[str, Any], key: str, where: str, kind: type, default: Any = None) -> Any:
    """``entry[key]`` (required unless ``default`` is given) as ``kind``: any value for ``str``, else
    a finite number >= 0, a whole one for ``int``; ValueError naming ``where`` and ``key`` otherwise."""
    if key not in entry and default is None:
        raise ValueError(f"{where}: no {key!r}")
    value = entry.get(key, default)
    if kind is str:
        return str(value)
    whole = kind is not int or (isinstance(value, (int, float)) and float(value).is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not whole:
        raise ValueError(f"{where}: {key!r} is {value!r:.40}, not {'an integer' if kind is int else 'a number'}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {key!r} is {value!r}, not a finite number >= 0")
    return kind(value)
