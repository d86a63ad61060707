"""JSON Lines files (prompt sets, golden files, training examples): one object a line, each bad line
named by file and line number."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .errors import RefengineError


def json_lines(path: Path) -> Iterator[tuple[str, dict]]:
    """("FILE:LINE", object) for every non-blank line of `path`; a line that is not a JSON object, or a
    file that cannot be read, is a RefengineError naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RefengineError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RefengineError(f"{path}:{number}: invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise RefengineError(f"{path}:{number}: expected a JSON object")
        yield f"{path}:{number}", obj
