"""Trace loaders: Azure LLM inference 2023, Mooncake, BurstGPT and a plain CSV.

| format   | file                          | arrival                         | prompt / output columns          |
|----------|-------------------------------|---------------------------------|----------------------------------|
| azure    | CSV                           | ``TIMESTAMP`` wall-clock string | ``ContextTokens``, ``GeneratedTokens`` |
| mooncake | JSONL, one object a line      | ``timestamp`` in ms             | ``input_length``, ``output_length`` |
| burstgpt | CSV                           | ``Timestamp`` in s              | ``Request tokens``, ``Response tokens`` |
| plain    | CSV                           | ``arrival_s``                   | ``prompt_tokens``, ``output_tokens`` |

The format is recognised from the header (or the ``.jsonl`` suffix).
Arrival times become offsets from the earliest request, and requests are
sorted by arrival. A malformed line raises ``ValueError`` naming the file,
the line and the field.

Prefix identity, where a trace has it: Mooncake's ``hash_ids`` (one id per
512-token block of the prompt, equal ids for equal prefixes), and in any CSV
format an optional ``hash_ids`` column with the same meaning, the ids
separated by spaces. Only the prompt's full blocks are kept (a partial last
block is never cached, ``core.prefix``), and the answer's blocks are unknown.
The Azure traces have no prefix identity.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from kairos_ray.workloads import Request, Workload

TRACE_BLOCK_TOKENS = 512
"""Tokens per block of a trace's ``hash_ids`` (Mooncake's)."""

HASH_IDS = "hash_ids"

Row = tuple[float, int, int, tuple[int, ...]]


class TraceError(ValueError):
    """A trace that cannot be read, with the file, line and field."""


def _number(path: Path, line: int, field: str, value: object, kind: Callable[[str], float | int]) -> float | int:
    try:
        number = kind(str(value).strip())
    except (TypeError, ValueError):
        raise TraceError(f"{path}:{line}: {field} = {value!r} is not a number") from None
    if number < 0:
        raise TraceError(f"{path}:{line}: {field} = {value!r} is negative")
    return number


def _azure_time(path: Path, line: int, value: str) -> float:
    text = value.strip()
    whole, _, fraction = text.partition(".")
    try:
        stamp = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
        return stamp + (float(f"0.{fraction}") if fraction else 0.0)
    except ValueError:
        raise TraceError(f"{path}:{line}: TIMESTAMP = {value!r} is not 'YYYY-MM-DD HH:MM:SS[.frac]'") from None


def _hash_ids(path: Path, line: int, values: list[object], prompt_tokens: int) -> tuple[int, ...]:
    """The ids of the prompt's full blocks."""
    ids = tuple(int(_number(path, line, HASH_IDS, v, int)) for v in values)
    return ids[: prompt_tokens // TRACE_BLOCK_TOKENS]


def _csv_rows(path: Path, reader: csv.DictReader[str], columns: tuple[str, str, str], azure: bool) -> Iterator[Row]:
    t_col, p_col, o_col = columns
    hashed = HASH_IDS in (reader.fieldnames or [])
    for row in reader:
        line = reader.line_num
        if None in row.values() or None in row:
            raise TraceError(f"{path}:{line}: expected {len(reader.fieldnames or [])} fields")
        arrival = _azure_time(path, line, row[t_col]) if azure else float(_number(path, line, t_col, row[t_col], float))
        prompt = int(_number(path, line, p_col, row[p_col], int))
        yield (
            arrival,
            prompt,
            int(_number(path, line, o_col, row[o_col], int)),
            _hash_ids(path, line, list(row[HASH_IDS].split()), prompt) if hashed else (),
        )


CSV_FORMATS: dict[str, tuple[tuple[str, str, str], bool]] = {
    "azure": (("TIMESTAMP", "ContextTokens", "GeneratedTokens"), True),
    "burstgpt": (("Timestamp", "Request tokens", "Response tokens"), False),
    "plain": (("arrival_s", "prompt_tokens", "output_tokens"), False),
}


def _mooncake_rows(path: Path, lines: Iterator[str]) -> Iterator[Row]:
    for line_no, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{line_no}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{line_no}: expected a JSON object")
        for field in ("timestamp", "input_length", "output_length"):
            if field not in obj:
                raise TraceError(f"{path}:{line_no}: missing field {field!r}")
        prompt = int(_number(path, line_no, "input_length", obj["input_length"], int))
        ids = obj.get(HASH_IDS, [])
        if not isinstance(ids, list):
            raise TraceError(f"{path}:{line_no}: {HASH_IDS} = {ids!r} is not a list")
        yield (
            float(_number(path, line_no, "timestamp", obj["timestamp"], float)) / 1000.0,
            prompt,
            int(_number(path, line_no, "output_length", obj["output_length"], int)),
            _hash_ids(path, line_no, ids, prompt),
        )


def load_trace(path: str | Path) -> Workload:
    """Read a trace in any supported format (see the module docstring)."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            if path.suffix == ".jsonl":
                rows = list(_mooncake_rows(path, f))
            else:
                reader = csv.DictReader(f)
                header = [name.strip() for name in reader.fieldnames or []]
                reader.fieldnames = header
                for columns, azure in CSV_FORMATS.values():
                    if all(c in header for c in columns):
                        rows = list(_csv_rows(path, reader, columns, azure))
                        break
                else:
                    known = "; ".join(", ".join(cols) for cols, _ in CSV_FORMATS.values())
                    raise TraceError(f"{path}: unrecognised header {header}; expected the columns of one of: {known}")
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    requests = tuple(Request(t - start, p, o, h) for t, p, o, h in rows)
    return Workload(path.stem, requests, block_tokens=TRACE_BLOCK_TOKENS)
