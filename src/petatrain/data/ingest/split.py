"""One large source file as several pieces that ingest reads in parallel.

A file over `ingest.split_size` is cut into chunks of that many bytes; a scan per chunk
(`BoundaryScan`, run as a plain Ray task: lighter to start than a Ray Data pipeline) moves
each cut forward to the next record boundary, counts the records in its piece and checksums
the file's blocks that start in its chunk. From the counts
the driver gives each piece its first record number, so the first stage reads the pieces
independently and still numbers every record as the whole file would: document ids, rejects
and dedup decisions do not depend on the split. The scan reads the file once more, at memory
speed (a newline count and a hash), which is cheap beside the parse it lets run on every core.

What splits: JSONL and text (a record is a line, and a raw newline never occurs inside a JSON
string), and CSV whose rows are its lines (no quote, no bare carriage return: a quoted field may
hold a line break, so a quoted CSV is read whole, and the summary says why). Compressed files
cannot be entered in the middle and are read by one task (a compressed JSONL or text file streamed
in pieces by it: `readers.read_stream`); so are Parquet, WebDataset and TFRecord (splitting them by
row group, sample or record is left for when a single such file is huge).

A split file keeps its fields as a whole read does. A JSONL piece stages them untyped, and
the pieces' kinds decide the file's types (`stages.split_field_types`). A CSV whose columns
besides the text are kept is read whole: Arrow infers a column's type from all its values
(`01` is an integer until a later row says `0A`), which no piece sees alone.

A split file's checksum in the lineage is the one a whole read gives: `xxh3-128` of the file
when it is one checksum block (64 MiB) or less, else `xxh3-128/64MiB`, the xxh3-128 of its
blocks' digests, however it was split.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash
from fsspec.utils import infer_compression

from petatrain.data import readers as src
from petatrain.errors import PetatrainError
from petatrain.storage import StorageOptions
from petatrain.storage.checksum import ALGORITHM
from petatrain.storage.fs import read_range

CHECKSUM_BLOCK = 64 << 20
_SCAN_STEP = 8 << 20
_QUOTED_CSV = "a CSV with quotes or bare carriage returns is read whole (a quoted field may hold a line break)"


def csv_fields(header: bytes, text_field: str, choice: src.FieldChoice) -> list[str]:
    """The columns besides the text that a split CSV would keep, from its header row (a CSV is
    split only where it has no quotes, so a comma always separates two names)."""
    names = header.decode("utf-8", "replace").rstrip("\r\n").split(",")
    return [n for n in names if n != text_field and choice.wanted(n)]


def split_format(url: str, fmt: str) -> str | None:
    """The format a file is split as, or None where it is read whole."""
    if infer_compression(url.lower()):
        return None
    try:
        fmt = src.detect_format(url) if fmt == "auto" else fmt
    except Exception:  # no format from its name: read whole, where the first stage quarantines it
        return None
    return fmt if fmt in src.SPLITTABLE else None  # the registry says which formats


def chunks(file_ord: int, url: str, size: int, fmt: str, split_bytes: int) -> list[dict[str, Any]]:
    """The nominal chunks of one file, as scan items."""
    return [
        {
            "file_ord": file_ord,
            "url": url,
            "size": size,
            "fmt": fmt,
            "chunk": k,
            "lo": lo,
            "hi": min(lo + split_bytes, size),
        }
        for k, lo in enumerate(range(0, size, split_bytes))
    ]


def checksum(size: int, block_digests: list[str]) -> str:
    """A source file's checksum from its blocks' digests (hex xxh3-128, in order); see the module docstring."""
    if size <= CHECKSUM_BLOCK:
        return f"{ALGORITHM}:{block_digests[0]}" if block_digests else f"{ALGORITHM}:{xxhash.xxh3_128_hexdigest(b'')}"
    tree = xxhash.xxh3_128()
    for digest in block_digests:
        tree.update(bytes.fromhex(digest))
    return f"{ALGORITHM}/64MiB:{tree.hexdigest()}"


def whole_file_checksum(data: bytes) -> str:
    """The same checksum, for a file read whole."""
    whole = StreamChecksum()
    whole.update(data)
    return whole.result()


class StreamChecksum:
    """The same checksum, for a file read front to back in parts (`update` each, in order)."""

    def __init__(self) -> None:
        self.size, self._block = 0, xxhash.xxh3_128()
        self._blocks: list[str] = []

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = CHECKSUM_BLOCK - self.size % CHECKSUM_BLOCK
            self._block.update(view[:take])
            self.size += min(take, len(view))
            view = view[take:]
            if self.size % CHECKSUM_BLOCK == 0:
                self._blocks.append(self._block.hexdigest())
                self._block = xxhash.xxh3_128()

    def result(self) -> str:
        tail = [self._block.hexdigest()] if self.size % CHECKSUM_BLOCK or not self.size else []
        return checksum(self.size, self._blocks + tail)


def scan_chunk(item: dict[str, Any], options: StorageOptions | None) -> dict[str, Any]:
    """`BoundaryScan` as a plain function, for a Ray task."""
    return BoundaryScan(options=options)(item)


class BoundaryScan:
    """A Ray task's body: one nominal chunk [lo, hi) of a file -> its piece [start, end) between
    record boundaries, the records in it, and the digests of the checksum blocks that start in
    the chunk. A record that straddles `hi` belongs to this piece; one that straddles `lo` to the
    piece before."""

    def __init__(self, *, options: StorageOptions | None):
        self.options = options

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        url, size, lo, hi, fmt = item["url"], int(item["size"]), int(item["lo"]), int(item["hi"]), item["fmt"]
        # A chunk inside one long line has no record of its own: it stops looking at `hi`, so
        # a line of many chunks is scanned to its end once (by its own piece), not once per chunk.
        start = self._boundary(url, lo, size, limit=hi)
        end = start if start >= hi else self._boundary(url, hi, size)
        first_block = -(-lo // CHECKSUM_BLOCK)
        last_block = -(-hi // CHECKSUM_BLOCK)  # blocks [first_block, last_block) start in [lo, hi)
        hash_from, hash_to = first_block * CHECKSUM_BLOCK, min(size, last_block * CHECKSUM_BLOCK)
        if first_block == last_block:  # no block starts here: read only the piece
            hash_from = hash_to = start
        digests = [xxhash.xxh3_128() for _ in range(first_block, last_block)]
        piece = xxhash.xxh3_128()  # of the piece's bytes: its reader checks that it reads these
        lines = _LineCount()
        pos, stop = min(start, hash_from), max(end, hash_to)
        while pos < stop:
            step_end = min(pos + _SCAN_STEP, stop)
            buf = memoryview(read_range(url, pos, step_end, self.options))
            if len(buf) != step_end - pos:
                raise PetatrainError(changed(url, f"it ended at byte {pos + len(buf)} of {size}"))
            a, b = max(pos, start), min(step_end, end)
            if a < b:
                lines.feed(buf[a - pos : b - pos], csv=fmt == "csv")
                piece.update(buf[a - pos : b - pos])
            a, b = max(pos, hash_from), min(step_end, hash_to)
            while a < b:
                block = a // CHECKSUM_BLOCK
                take = min(b, (block + 1) * CHECKSUM_BLOCK)
                digests[block - first_block].update(buf[a - pos : take - pos])
                a = take
            pos = step_end
        lines.finish()
        header_end = self._boundary(url, 1, size) if fmt == "csv" and lo == 0 else 0
        header = xxhash.xxh3_128_hexdigest(read_range(url, 0, header_end, self.options)) if header_end else ""
        return {
            "file_ord": item["file_ord"],
            "chunk": item["chunk"],
            "fmt": fmt,
            "size": size,
            "start": start,
            "end": end,
            "newlines": lines.newlines,
            "rows": lines.nonempty,
            "rows_are_lines": lines.rows_are_lines and (fmt != "csv" or lo > 0 or self._header_first(url, size)),
            "header_end": header_end,
            "header_digest": header,
            "digest": piece.hexdigest(),
            "blocks": json.dumps([d.hexdigest() for d in digests]),  # a string: no list column to unify
        }

    def _boundary(self, url: str, at: int, size: int, limit: int | None = None) -> int:
        """The first record start at or after `at` (just after the first newline at or after
        `at - 1`), or `limit` (default: the end of the file) if there is none before it."""
        stop = size if limit is None else min(limit, size)
        if at <= 0 or at >= stop:
            return min(max(at, 0), stop)
        pos = at - 1
        while pos < stop:
            buf = read_range(url, pos, min(pos + (1 << 20), stop), self.options)
            if not buf:  # cut short since it was listed: looking on would never end
                raise PetatrainError(changed(url, f"it ended at byte {pos} of {size}"))
            found = buf.find(b"\n")
            if found >= 0:
                return pos + found + 1
            pos += len(buf)
        return stop

    def _header_first(self, url: str, size: int) -> bool:
        """Whether a CSV's first line is its header, not a blank line Arrow would skip."""
        return read_range(url, 0, min(size, 1), self.options) not in (b"\n", b"\r")


class _LineCount:
    """Lines in a piece fed in buffers: newlines for line formats; for CSV also the non-empty
    lines (Arrow's rows) and whether rows are lines at all (see `readers.csv_rows_are_lines`)."""

    def __init__(self) -> None:
        self.newlines = 0
        self.nonempty = 0
        self.rows_are_lines = True
        self._open = b""  # the unterminated line so far: b"", b"\r" or b"x" (some content)
        self._cr = False  # the last buffer ended in a carriage return

    def feed(self, buf: memoryview, *, csv: bool) -> None:
        raw = bytes(buf)
        self.newlines += raw.count(b"\n")
        if not csv:
            return
        # A CR at a buffer's end is checked against the next buffer's first byte (a CRLF cut in two).
        if (self._cr and not raw.startswith(b"\n")) or not src.csv_rows_are_lines(raw.removesuffix(b"\r")):
            self.rows_are_lines = False
        self._cr = raw.endswith(b"\r")
        parts = raw.split(b"\n")
        parts[0] = self._open + parts[0]
        self.nonempty += sum(1 for line in parts[:-1] if line and line != b"\r")
        last = parts[-1]
        self._open = b"" if not last else b"\r" if last == b"\r" else b"x"

    def finish(self) -> None:
        if self._open == b"x":
            self.nonempty += 1  # a last line without a line break is a row


def changed(url: str, how: str) -> str:
    """The one line for a source file that changed while an ingest read it."""
    return (
        f"source changed during the ingest: {url} ({how}); nothing was committed: ingest it again once it is "
        "no longer written to"
    )


def check_piece(url: str, item: dict[str, Any], data: bytes, header: bytes) -> None:
    """A piece's reader read the bytes its scan saw (PetatrainError otherwise): a file replaced,
    rewritten or cut between the scan and the read must not mix two versions, or lose rows."""
    start, end = int(item["start"]), int(item["end"])
    if len(data) != end - start:
        raise PetatrainError(changed(url, f"bytes [{start}, {end}) read as {len(data)} bytes"))
    if xxhash.xxh3_128_hexdigest(data) != item["digest"]:
        raise PetatrainError(changed(url, f"bytes [{start}, {end}) differ from what the split scan read"))
    if header and xxhash.xxh3_128_hexdigest(header) != item["header_digest"]:
        raise PetatrainError(changed(url, "its header row differs from what the split scan read"))


def plan_pieces(scans: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per split file (by file_ord): its pieces (start, end, first_record, header_end) and checksum,
    or the reason it is read whole after all."""
    by_file: dict[int, list[dict[str, Any]]] = {}
    for scan in sorted(scans, key=lambda s: (s["file_ord"], s["chunk"])):
        by_file.setdefault(int(scan["file_ord"]), []).append(scan)
    plans: dict[int, dict[str, Any]] = {}
    for file_ord, file_scans in by_file.items():
        size, csv = int(file_scans[0]["size"]), file_scans[0]["fmt"] == "csv"
        if not all(s["rows_are_lines"] for s in file_scans):
            plans[file_ord] = {"whole": _QUOTED_CSV}
            continue
        blocks = [d for s in file_scans for d in json.loads(s["blocks"])]
        pieces, first = [], 0
        header_end, header_digest = file_scans[0]["header_end"], file_scans[0]["header_digest"]
        for scan in file_scans:
            if scan["end"] > scan["start"]:
                record = first if not csv else max(first - 1, 0)  # CSV rows are counted without the header
                pieces.append(
                    {
                        "start": scan["start"],
                        "end": scan["end"],
                        "first_record": record if scan["start"] > 0 else 0,
                        "header_end": header_end if csv and scan["start"] > 0 else 0,
                        "header_digest": header_digest if csv and scan["start"] > 0 else "",
                        "digest": scan["digest"],
                    }
                )
            first += scan["rows"] if csv else scan["newlines"]
        plans[file_ord] = {
            "pieces": pieces,
            "checksum": checksum(size, blocks),
            "size": size,
            "header_end": header_end if csv else 0,
        }
    return plans
