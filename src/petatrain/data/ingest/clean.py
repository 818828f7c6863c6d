"""Record cleaning: Unicode NFC, and quarantine of empty, oversized or unencodable text."""

from __future__ import annotations

import unicodedata

from petatrain.data.readers import FileRecords


def clean(records: FileRecords, *, min_chars: int, max_chars: int) -> FileRecords:
    """Normalise kept records to NFC; move the ones that fail a rule to rejects (their fields go with them)."""
    out = FileRecords(rejects=list(records.rejects))
    positions, texts = [], []
    for position, (index, text) in enumerate(zip(records.index, records.text, strict=True)):
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # lone surrogates from JSON \\ud800 escapes
                out.reject(index, "invalid_utf8", str(exc)[:200], text.encode("utf-8", "surrogatepass"))
                continue
            if not unicodedata.is_normalized("NFC", text):
                text = unicodedata.normalize("NFC", text)
        if not text.strip():
            out.reject(index, "empty", "", text.encode("utf-8"))
        elif len(text) > max_chars:
            out.reject(index, "too_long", f"{len(text)} chars > {max_chars}", text.encode("utf-8"))
        elif len(text) < min_chars:
            out.reject(index, "too_short", f"{len(text)} chars < {min_chars}", text.encode("utf-8"))
        else:
            positions.append(position)
            texts.append(text)
    kept = records.subset(positions) if len(positions) < len(records.index) else records
    kept.rejects, kept.text = out.rejects, texts
    return kept
