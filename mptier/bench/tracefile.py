"""Reading a request trace (Mooncake's FAST'25 format) for ``mptier bench --trace``.

One JSON object per line: ``timestamp`` (ms, not decreasing), ``input_length`` (tokens),
``output_length`` (tokens) and ``hash_ids``, one id per block of
:data:`TRACE_TOKENS_PER_BLOCK` tokens of the input; requests that share a prefix share
its ids. A line that does not fit raises :class:`TraceError` naming the file, the line
and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# Tokens behind one hash id in Mooncake's traces (their release says 512 per block).
TRACE_TOKENS_PER_BLOCK = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    line: int
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self) -> list[int]:
        """Tokens of each block, in order (the last one may be partial)."""
        per = TRACE_TOKENS_PER_BLOCK
        return [min(per, self.input_length - i * per) for i in range(len(self.hash_ids))]


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_line(text: str, line: int, where: str) -> TraceRequest:
    """One request from one line of ``where``; raises :class:`TraceError`."""
    def bad(field: str, problem: str) -> TraceError:
        return TraceError(f"{where}, line {line}: field {field!r} {problem}")

    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise TraceError(f"{where}, line {line}: not a JSON object ({exc}); each line "
                         f"must be one object with the fields {', '.join(FIELDS)}") from None
    if not isinstance(doc, dict):
        raise TraceError(f"{where}, line {line}: a JSON {type(doc).__name__}, not an "
                         f"object with the fields {', '.join(FIELDS)}")
    for field in FIELDS:
        if field not in doc:
            raise bad(field, "is missing")
    stamp = doc["timestamp"]
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or \
            not math.isfinite(stamp) or stamp < 0:
        raise bad("timestamp", f"is {stamp!r}; it must be a number of ms, 0 or more")
    for field in ("input_length", "output_length"):
        if not _whole(doc[field]) or doc[field] < 0:
            raise bad(field, f"is {doc[field]!r}; it must be a whole number of tokens, "
                             "0 or more")
    ids = doc["hash_ids"]
    if not isinstance(ids, list) or not all(_whole(i) and i >= 0 for i in ids):
        shown = ids if not isinstance(ids, list) else \
            next(i for i in ids if not (_whole(i) and i >= 0))
        raise bad("hash_ids", f"holds {shown!r}; it must be a list of whole numbers, "
                              "0 or more")
    want = math.ceil(doc["input_length"] / TRACE_TOKENS_PER_BLOCK)
    if len(ids) != want:
        raise bad("hash_ids", f"has {len(ids)} ids, but input_length "
                              f"{doc['input_length']} is {want} blocks of "
                              f"{TRACE_TOKENS_PER_BLOCK} tokens")
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise bad("hash_ids", f"names block {twice} twice; a prefix holds each block once")
    return TraceRequest(line, float(stamp), doc["input_length"], doc["output_length"],
                        tuple(ids))


def read_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace at ``path`` (all when None), in file
    order. Raises :class:`TraceError` for a bad line, an empty trace or timestamps that
    go back, ``OSError`` when the file cannot be read."""
    if limit is not None and limit < 1:
        raise TraceError(f"--requests {limit}: need 1 or more requests")
    out: list[TraceRequest] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"{path}, line {number}: not UTF-8 text ({exc.reason} at "
                                 f"byte {exc.start}); is this a JSONL trace?") from None
            if limit is not None and len(out) >= limit:
                break
            if not text.strip():
                continue
            request = parse_line(text, number, path)
            if out and request.timestamp < out[-1].timestamp:
                raise TraceError(
                    f"{path}, line {number}: field 'timestamp' is {request.timestamp:g}, "
                    f"earlier than {out[-1].timestamp:g} on line {out[-1].line}; the "
                    "replay keeps the trace's order, so sort the file by timestamp")
            out.append(request)
    if not out:
        raise TraceError(f"{path}: no requests (an empty file?)")
    return out


def footprint_blocks(requests: list[TraceRequest]) -> int:
    """Distinct blocks the requests name: what an unbounded cache would hold."""
    return len({i for r in requests for i in r.hash_ids})
