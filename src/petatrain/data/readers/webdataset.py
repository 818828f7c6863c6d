"""WebDataset tars: a sample is a run of members sharing a key; its text is one member."""

from __future__ import annotations

import io
import os
import tarfile
from typing import Any

from petatrain.data.readers.base import RAW_PREFIX_BYTES, FileRecords, decode_utf8, parse_json, take_field


def read(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    """Samples are runs of adjacent members sharing a key (the path up to the name's first
    dot), as in WebDataset: a key that comes back after another one, or an extension that
    repeats within a run, starts a new sample, so no member is ever overwritten. Each
    sample is taken when its run ends, so a tar cut short keeps the samples before the cut."""
    number, key = -1, ""
    members: dict[str, tarfile.TarInfo] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for member in tar:
            base = os.path.basename(member.name)
            if not member.isfile() or "." not in base:
                continue
            stem, ext = base.split(".", 1)
            ext = ext.lower()
            member_key = os.path.join(os.path.dirname(member.name), stem)
            if member_key != key or ext in members:
                if members:
                    _take_sample(number, key, members, tar, text_field, max_bytes, out)
                number, key, members = number + 1, member_key, {}
            members[ext] = member
        if members:
            _take_sample(number, key, members, tar, text_field, max_bytes, out)


def _take_sample(
    number: int,
    key: str,
    members: dict[str, tarfile.TarInfo],
    tar: tarfile.TarFile,
    text_field: str,
    max_bytes: int,
    out: FileRecords,
) -> None:
    """The sample's text: member `.text_field`, else `.txt`, else the field of `.json`.
    Only that member is read, and only if it is within `max_bytes`; with fields asked for,
    the other members too (each a field named by its extension: text where it decodes as
    UTF-8, else bytes) and the sample's `__key__`."""
    ext = next((e for e in (text_field, "txt", "json") if e in members), None)
    if ext is None:
        out.reject(number, "missing_field", f"sample {key} has no .{text_field}, .txt or .json member")
        return
    extra: dict[str, Any] = {}
    wanted = [e for e in members if e != ext and out.choice is not None and out.choice.wanted(e)]
    for name in [ext, *wanted]:
        member = members[name]
        handle = tar.extractfile(member)
        assert handle is not None  # members are regular files (`member.isfile()`)
        if member.size > max_bytes:
            detail = f"{member.name} is {member.size} bytes, over the {max_bytes}-byte cap that max_chars sets"
            out.reject(number, "too_long", detail, handle.read(RAW_PREFIX_BYTES))
            return
        if name != ext:
            data = handle.read()
            try:
                extra[name] = data.decode("utf-8")
            except UnicodeDecodeError:
                extra[name] = data
    if out.choice is not None and out.choice.wanted("__key__"):
        extra["__key__"] = key
    handle = tar.extractfile(members[ext])
    assert handle is not None
    raw = handle.read()
    if ext == "json" and text_field != "json":
        parsed, value = parse_json(number, raw, out)
        if parsed:
            take_field(number, value, text_field, raw, out, extra)
    else:
        text = decode_utf8(number, raw, out)
        if text is not None:
            out.keep(number, text, extra)
