"""Streaming loader: exactly-once, deterministic, elastic-resumable, as fast as the bytes.

`StreamingDataset` is a torch `IterableDataset` over a dataset written by
`petatrain ingest`; `loader()` wraps it in a DataLoader that yields batches and keeps
the resume state. See `order.py` for how the sample sequence is built and dealt out.

Resuming is allowed for any world size and any number of workers: the state holds the
global position in the epoch's sequence (samples consumed by all ranks together), and
the remaining sequence is dealt out again to whatever layout loads it. The only
condition is the training loop's lockstep: when the state is saved, every rank has
consumed the same number of samples (true at any step boundary of data-parallel
training), so any rank's state describes the global position.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from petatrain.data import index as idx
from petatrain.data.loading.cache import ShardCache, default_cache_dir
from petatrain.data.loading.continuation import ContinuedOrder, Switch
from petatrain.data.loading.heldout import HeldOut
from petatrain.data.loading.order import Deal, SampleOrder
from petatrain.data.partitions import hive_partitions, partition_array
from petatrain.errors import CorruptDataError, PetatrainError
from petatrain.security.parquet_crypt import open_parquet
from petatrain.storage import StorageOptions
from petatrain.storage.fs import is_local

log = logging.getLogger(__name__)

STATE_VERSION = 1
_WINDOW_SHARDS = 4  # default shuffle window: about this many shards' worth of samples
_GROUP_ROWS = 1024  # rows gathered at once; batches are views of the gathered block
_MAX_PAGE_HEADER = 256  # bytes; one Parquet page header (no statistics) is ~30
# Shuffle windows loaded ahead of the one being read. Two, so that a window whose shards cost
# CPU to load (encrypted: decrypted and decoded) has a whole window's time to load in.
_AHEAD_WINDOWS = 2
# The prefetch threads' nice value above the loop's (Linux: per thread). Where the cores are
# busy, the loop taking batches keeps its core and the prefetch, which is ahead, takes the rest.
_PREFETCH_NICE = 10


class StreamingDataset(IterableDataset):
    """Samples of a petatrain dataset, each a dict of column -> value plus its global row `index`.

    Keyword arguments:
        columns: columns to read (default: all); only those are read from storage.
        seed, shuffle, epoch: the sequence is a pure function of (dataset, seed, epoch).
        rank, world_size: default from torch.distributed when initialised, else 0 and 1.
        batch_size: the DataLoader batch size this dataset is used with (workers are
            handed whole batches, so the order does not depend on the worker count).
        shuffle_window: samples shuffled together (default: about 4 shards' worth).
        drop_last: cut the epoch tail to a multiple of world_size * batch_size, so every
            rank gets the same number of full batches; `dropped` counts the cut samples.
        cache_dir, cache_limit: node-local shard cache for remote datasets (shared by the
            ranks and workers of a node), and its byte limit with LRU eviction.
        shards: (start, stop) to read only those shards, e.g. a held-out split; samples
            keep their global row `index`.
        held_out, split: with a fraction > 0, that share of every shard's rows is held out for
            evaluation (`loading/heldout.py`: the same rows in every later version), and the
            loader reads the "train" rows or the held-out "eval" ones.
    A loader state that records a continuation (`loading/continuation.py`) makes its epoch the
    pass that carries a run from an earlier version onto this one.
    """

    def __init__(
        self,
        url: str,
        *,
        columns: list[str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        epoch: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        batch_size: int = 1,
        shuffle_window: int | None = None,
        drop_last: bool = False,
        cache_dir: str | None = None,
        cache_limit: int | None = None,
        options: StorageOptions | None = None,
        prefetch: bool = True,
        shards: tuple[int, int] | None = None,
        held_out: float = 0.0,
        split: str = "train",
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.url = url
        self.options = options
        self.shard_range = tuple(shards) if shards is not None else None
        if rank is None or world_size is None:
            dist = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if dist else 0 if rank is None else rank
            world_size = torch.distributed.get_world_size() if dist else 1 if world_size is None else world_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.epoch = seed, shuffle, epoch
        self.batch_size, self.drop_last, self.prefetch = batch_size, drop_last, prefetch
        self.root = idx.split_version(url)[0]  # `DATASET@vN` reads version N of the dataset there
        remote = not is_local(url)
        self.cache_dir = cache_dir or (default_cache_dir(self.root) if remote else None)
        self.cache_limit = cache_limit
        dataset = idx.open_dataset(url, options, cache_dir=self.cache_dir)
        manifest, listed = dataset.manifest, dataset.shards
        self.manifest = manifest
        self._paths = listed.column("path").combine_chunks()
        self._checksums = listed.column("checksum").combine_chunks()
        self._rows = idx.int64s(listed.column("rows"))
        self._bytes = idx.int64s(listed.column("bytes"))
        self._first_row = idx.int64s(listed.column("first_row"))
        self._keys = listed.column("key").combine_chunks()
        # A signed manifest's shards are checked against their SHA-256 too (as they are fetched).
        self._sha256 = listed.column("sha256").combine_chunks() if manifest.signed else None
        self.crypt = idx.dataset_keys(url, manifest, options)  # None: no shard is encrypted
        if self.crypt is not None:
            self.crypt.check()  # a wrong keyring: one line now, not in a prefetch thread later
        if self.shard_range is not None:  # a split: shards [start, stop) only, global row indexes kept
            lo, hi = self.shard_range
            if not 0 <= lo < hi <= len(self._rows):
                raise ValueError(f"shards={self.shard_range} is not a range within the {len(self._rows)} shards")
            self._paths, self._checksums, self._keys = self._paths[lo:hi], self._checksums[lo:hi], self._keys[lo:hi]
            self._sha256 = self._sha256[lo:hi] if self._sha256 is not None else None
            self._rows, self._bytes, self._first_row = self._rows[lo:hi], self._bytes[lo:hi], self._first_row[lo:hi]
        first_shard = self.shard_range[0] if self.shard_range is not None else 0
        self.held_out = HeldOut(self._rows, held_out, first_shard=first_shard) if held_out else None
        self.eval_fraction, self.split = float(held_out), split
        # The rows the sequence deals out, per shard: every row, or one side of the held-out split.
        self._counts = self._rows
        if self.held_out is not None:
            self._counts = self.held_out.train_counts() if split == "train" else self.held_out.eval_counts()
        self.continuation: Switch | None = None  # set by a loader state that continues from another version
        names = [c.name for c in manifest.schema]
        if columns is not None:
            unknown = [c for c in columns if c not in names]
            if unknown:
                raise PetatrainError(f"no column {unknown[0]!r} in {url} (columns: {', '.join(names)})")
        self.columns = list(columns) if columns is not None else names
        self.token_dtype = idx.token_dtype(url, manifest)
        mean_rows = float(self._counts.mean()) if len(self._counts) else 1.0
        self.shuffle_window = int(shuffle_window or max(1, math.ceil(_WINDOW_SHARDS * mean_rows)))
        self._start = 0  # global position in this epoch's sequence where iteration resumes
        self._yielded = 0  # samples this process yielded since _start (main-process iteration)
        self._order_cache: SampleOrder | ContinuedOrder | None = None
        self._handoff: _Handoff | None = None  # the next epoch's reader, started near this one's end

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handoff"] = None  # threads and loaded shards stay in the process that has them
        state["_order_cache"] = None  # rebuilt on use (its window cache does not pickle)
        return state

    # -- sequence --------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples in one epoch of the whole dataset (all ranks): its rows, or one side of its split."""
        return int(self._counts.sum())

    def order(self) -> SampleOrder | ContinuedOrder:
        o = self._order_cache
        if o is None or o.epoch != self.epoch:
            handoff = self._handoff
            if handoff is not None and handoff.key[1:5] == (self.epoch, self.seed, self.shuffle, self.shuffle_window):
                o = handoff.order  # computed when the handoff was started
            else:
                o = self._sample_order(self.epoch)
            self._order_cache = o
        return o

    def _sample_order(self, epoch: int) -> SampleOrder | ContinuedOrder:
        switch = self.continuation
        if switch is not None and epoch == switch.epoch:  # the pass onto this version
            old, new = self._counts[: switch.old_shards], self._counts[switch.old_shards :]
            return ContinuedOrder(
                old, new, switch=switch, to_version=self.manifest.generation, seed=self.seed, shuffle=self.shuffle,
                window=self.shuffle_window,
            )  # fmt: skip
        return SampleOrder(self._counts, seed=self.seed, epoch=epoch, shuffle=self.shuffle, window=self.shuffle_window)

    def _row_of(self, shards: np.ndarray, k: np.ndarray) -> np.ndarray:
        """The row of each shard that is the k-th the sequence reads there (a split skips the other side's)."""
        if self.held_out is None:
            return k
        return self.held_out.train_row(shards, k) if self.split == "train" else self.held_out.eval_row(shards, k)

    def deal(self) -> Deal:
        return self.order().deal(
            self._start, self.rank, self.world_size, drop_last=self.drop_last, batch_size=self.batch_size
        )

    def __len__(self) -> int:
        """Samples this rank consumes from the current position to the end of the epoch."""
        return self.deal().count

    @property
    def dropped(self) -> int:
        """Samples of the epoch tail that drop_last leaves out (all ranks together)."""
        return self.deal().dropped

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._start, self._yielded = epoch, 0, 0

    # -- resume ----------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Small JSON state. `consumed`: samples this rank consumed since the last (re)start;
        default: what this process yielded itself (main-process iteration)."""
        consumed = self._yielded if consumed is None else consumed
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self._start + consumed * self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "dataset_version": self.manifest.generation,  # the dataset's commit it reads (DATASET@vN)
            **({"held_out": self.eval_fraction} if self.held_out is not None else {}),
            **({"continuation": self.continuation.to_json()} if self.continuation else {}),
        }

    def carried_over(self, state: dict[str, Any], replay: float) -> dict[str, Any]:
        """The state that carries a position saved in an earlier version of this dataset onto this
        version (`train --continue`): the next pass reads every row the later versions added once,
        with a `replay` share of the earlier version's rows, continuing that version's own sequence
        from where the state was (`loading/continuation.py`); the epochs after it read this version
        whole. PetatrainError, one line, for a state this cannot carry."""
        old_version, here = state.get("dataset_version"), self.manifest.generation
        if not isinstance(old_version, int) or old_version > here:
            raise PetatrainError(
                f"the loader state counts in version {old_version} of {self.root}; {self.url} is version {here}: "
                "a run continues onto the same or a later version"
            )
        if state.get("held_out") != (self.eval_fraction if self.held_out is not None else None):
            raise PetatrainError(
                f"the loader state holds out {state.get('held_out') or 'no'} rows per shard, this loader "
                f"{self.eval_fraction if self.held_out is not None else 'none'}: a run continues with the "
                "held-out split it trained with (data.eval_split: rows and its data.eval_fraction)"
            )
        if old_version == here:
            return state
        if self.shard_range is not None:
            raise PetatrainError("a loader over a range of shards cannot carry a run onto a later version")
        earlier = state.get("continuation")
        if earlier is not None and earlier.get("epoch") == state.get("epoch"):
            raise PetatrainError(
                f"the loader state is inside its own carry-over pass onto version {old_version}; continue "
                "from a checkpoint after that pass (its new rows read once) ended"
            )
        old_shards = idx.open_dataset(f"{self.root}@v{old_version}", self.options).manifest.totals.shards
        old_samples = int(self._counts[:old_shards].sum())
        if old_shards > len(self._counts) or old_samples != state.get("num_samples"):
            raise PetatrainError(
                f"version {old_version} of {self.root} has {old_samples} samples in its first {old_shards} "
                f"shards; the loader state counts {state.get('num_samples')}: not the dataset the run trained on"
            )
        switch = Switch(
            from_version=old_version, old_shards=old_shards, epoch=int(state["epoch"]),
            position=int(state["position"]), replay=float(replay), window=int(state["shuffle_window"]),
        )  # fmt: skip
        carried = dict(state, dataset_version=here, continuation=switch.to_json(), position=0)
        carried.update(num_samples=self.num_samples, shuffle_window=self.shuffle_window)
        return carried

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the exact next sample of the saved sequence, for any rank/worker layout."""
        if state.get("version") != STATE_VERSION:
            raise PetatrainError(f"loader state version {state.get('version')} is not {STATE_VERSION}")
        version = state.get("dataset_version")
        if version is not None and version != self.manifest.generation:
            raise PetatrainError(
                f"loader state is for version {version} of {self.root}; this loader reads version "
                f"{self.manifest.generation} ({self.root}@v{version} opens the one it is for)"
            )
        if state["num_samples"] != self.num_samples:
            raise PetatrainError(
                f"loader state is for a dataset of {state['num_samples']} samples; {self.url} has {self.num_samples}"
            )
        held = self.eval_fraction if self.held_out is not None else None
        if state.get("held_out") != held:
            raise PetatrainError(
                f"loader state holds out {state.get('held_out') or 'no'} rows per shard; this loader {held or 'none'}"
            )
        for key in ("seed", "shuffle", "shuffle_window"):
            if state[key] != getattr(self, key):
                raise PetatrainError(f"loader state has {key}={state[key]!r}, this loader {getattr(self, key)!r}")
        try:
            switch = Switch.from_json(state["continuation"]) if "continuation" in state else None
        except ValueError as exc:
            raise PetatrainError(str(exc)) from None
        if switch is not None and switch.old_shards > len(self._counts):
            raise PetatrainError(f"loader state continues from {switch.old_shards} shards; {self.url} has fewer")
        self.continuation, self._order_cache = switch, None
        if not 0 <= state["position"] <= self._sample_order(state["epoch"]).num_samples:
            raise PetatrainError(f"loader state position {state['position']} is outside the epoch")
        self.epoch, self._start, self._yielded = state["epoch"], int(state["position"]), 0

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        for batch in self._batches(self._reader(worker_id, num_workers), worker_id, num_workers):
            n = len(batch["index"])
            for i in range(n):
                sample = {k: v[i] for k, v in batch.items()}
                sample["index"] = int(batch["index"][i])
                if worker is None:
                    self._yielded += 1
                yield sample

    def iter_batches(self, worker_id: int = 0, num_workers: int = 1) -> Iterator[dict[str, Any]]:
        """This rank's batches j with j % num_workers == worker_id, as dicts of tensors/lists."""
        return self._batches(self._reader(worker_id, num_workers), worker_id, num_workers)

    def _layout(self, epoch: int, start: int, worker_id: int, num_workers: int) -> tuple:
        """What an iteration's sequence depends on, and the process it runs in."""
        return (
            os.getpid(),
            epoch,
            self.seed,
            self.shuffle,
            self.shuffle_window,
            start,
            self.rank,
            self.world_size,
            self.batch_size,
            self.drop_last,
            worker_id,
            num_workers,
        )

    def _reader(self, worker_id: int, num_workers: int) -> _ShardReader:
        """The reader the last epoch started for this iteration (its first window loading or
        loaded), or a new one."""
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            if handoff.key == self._layout(self.epoch, self._start, worker_id, num_workers):
                return handoff.reader
            if handoff.key[0] == os.getpid():  # a forked child has the object, not the threads
                handoff.reader.close()
        return _ShardReader(self)

    def _start_next_epoch(self, worker_id: int, num_workers: int) -> None:
        """Start loading epoch + 1's first window now, in a reader of its own, so that the next
        epoch does not begin by waiting for it. Its threads end once those shards are loaded."""
        if get_worker_info() is not None:  # a DataLoader worker process may not see the next epoch
            return
        order = self._sample_order(self.epoch + 1)
        deal = order.deal(0, self.rank, self.world_size, drop_last=self.drop_last, batch_size=self.batch_size)
        first = worker_id * self.batch_size
        if deal.count <= first:
            return
        reader = _ShardReader(self)
        reader.prefetch(_window_shards(order, int(deal.positions(first, first + 1)[0] // order.window)))
        reader.release_threads()
        self._handoff = _Handoff(self._layout(self.epoch + 1, 0, worker_id, num_workers), order, reader)

    def _batches(self, reader: _ShardReader, worker_id: int, num_workers: int) -> Iterator[dict[str, Any]]:
        """This worker's batches, read `group` batches at a time.

        One locate + gather for a group of batches, then each batch is a slice (a view)
        of it: the per-batch Python cost stays small even for small batches.
        """
        order, deal = self.order(), self.deal()
        b = self.batch_size
        n_batches = math.ceil(deal.count / b)
        mine = range(worker_id, n_batches, num_workers)
        group = max(1, _GROUP_ROWS // b)
        last_window = -1
        started_next = finished = False
        try:
            for g in range(0, len(mine), group):
                batches = mine[g : g + group]
                if num_workers == 1:  # consecutive batches: one range of local positions
                    positions = deal.positions(batches[0] * b, (batches[-1] + 1) * b)
                    sizes = [b] * (len(positions) // b) + ([len(positions) % b] if len(positions) % b else [])
                else:
                    spans = [deal.positions(j * b, (j + 1) * b) for j in batches]
                    positions = np.concatenate(spans)
                    sizes = [len(span) for span in spans]
                if last_window < 0 and self.prefetch:  # load the first window's shards in parallel
                    reader.prefetch(_window_shards(order, int(positions[0] // order.window)))
                shards, rows = order.locate(positions)
                gathered = reader.read(shards, self._row_of(shards, rows))
                offset = 0
                for size in sizes:
                    yield {k: v[offset : offset + size] for k, v in gathered.items()}
                    offset += size
                # Once a window's first batches are out (its shards are loaded), fetch the
                # next windows' in the background; earlier would delay the first batch.
                window = int(positions[-1] // order.window)
                if window != last_window and self.prefetch:
                    for ahead in range(1, _AHEAD_WINDOWS + 1):
                        reader.prefetch(_window_shards(order, window + ahead))
                    last_window = window
                    # Near the epoch's end there is less ahead to load: load the next epoch's start.
                    if not started_next and (window + _AHEAD_WINDOWS) * order.window >= order.num_samples:
                        self._start_next_epoch(worker_id, num_workers)
                        started_next = True
            finished = True
        finally:
            reader.close()
            if started_next and not finished and self._handoff is not None:  # broken off: not needed
                self._handoff.reader.close()
                self._handoff = None


def _window_shards(order: SampleOrder | ContinuedOrder, window: int) -> list[int]:
    return order.window_shards(window)


class _Shard:
    """A decoded shard: its table, and numpy views of the fixed-width and numeric columns."""

    def __init__(self, table: pa.Table | None, token_dtype: np.dtype, arrays: dict[str, np.ndarray] | None = None):
        self.table = table
        self.arrays: dict[str, np.ndarray] = dict(arrays or {})
        if table is None:
            return
        for name in table.column_names:
            column = table.column(name)
            # One chunk (as `_load` leaves it) is taken as it is: combine_chunks would copy it.
            array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
            kind = array.type
            if name == "tokens" and pa.types.is_fixed_size_binary(kind):
                width = kind.byte_width // token_dtype.itemsize
                flat = np.frombuffer(
                    array.buffers()[1],
                    dtype=token_dtype,
                    count=len(array) * width,
                    offset=array.offset * kind.byte_width,
                )
                self.arrays[name] = flat.reshape(len(array), width)
            elif (pa.types.is_integer(kind) or pa.types.is_floating(kind)) and array.null_count == 0:
                self.arrays[name] = array.to_numpy()


def _zero_copy_view(
    source: pa.MemoryMappedFile, meta: pq.FileMetaData, name: str, dtype: np.dtype
) -> np.ndarray | None:
    """The values of a fixed-width column straight from the mapped file, or None.

    Possible when the column is stored as ingest writes packed tokens: one row group,
    one uncompressed PLAIN data page, required (no definition levels), no dictionary.
    The page is then a small header followed by the rows' bytes, back to back.
    """
    if meta.num_row_groups != 1:
        return None
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if name not in names:
        return None
    column = meta.schema.column(names.index(name))
    chunk = meta.row_group(0).column(names.index(name))
    if (
        column.physical_type != "FIXED_LEN_BYTE_ARRAY"
        or column.max_definition_level != 0
        or chunk.compression != "UNCOMPRESSED"
        or chunk.has_dictionary_page
    ):
        return None
    width = column.length
    values = meta.num_rows * width
    header = chunk.total_compressed_size - values
    if not 0 < header <= _MAX_PAGE_HEADER:  # more than one page header: not one contiguous run
        return None
    start = chunk.data_page_offset + header
    flat = np.frombuffer(_mapped(source), dtype=np.uint8, count=values, offset=start)
    return flat.view(dtype).reshape(meta.num_rows, width // dtype.itemsize)


def _mapped(source: pa.MemoryMappedFile) -> pa.Buffer:
    source.seek(0)
    return source.read_buffer()


@dataclass(frozen=True)
class _Handoff:
    key: tuple  # StreamingDataset._layout of the iteration it is for
    order: SampleOrder | ContinuedOrder
    reader: _ShardReader


class _ShardReader:
    """Opens shards (through the cache), keeps the recent ones, prefetches the next window's."""

    def __init__(self, ds: StreamingDataset):
        self.ds = ds
        self.cache = ShardCache(ds.cache_dir, limit_bytes=ds.cache_limit, options=ds.options)
        mean = float(ds._rows.mean()) if len(ds._rows) else 1.0
        self.keep = max(4, 2 * math.ceil(ds.shuffle_window / max(mean, 1.0)) + 2)
        self.shards: OrderedDict[int, _Shard] = OrderedDict()
        self.pending: dict[int, Future] = {}
        self.pool: ThreadPoolExecutor | None = None  # started by the first prefetch
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            pool, self.pool = self.pool, None
            for future in self.pending.values():  # also those of a released pool
                future.cancel()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def release_threads(self) -> None:
        """Let the threads end once the loads asked for so far are done (a later prefetch
        starts new ones): a reader waiting for its epoch holds no idle threads."""
        with self.lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def _load(self, shard: int) -> _Shard:
        ds = self.ds
        url = _shard_url(ds, shard)
        sha = ds._sha256[shard].as_py() if ds._sha256 is not None else ""
        source = self.cache.open(url, ds._checksums[shard].as_py(), int(ds._bytes[shard]), sha)
        # An encrypted shard's pages are decrypted by Parquet; its fixed-width tokens are then still
        # viewed without a copy (`_Shard`), only not straight from the mapped file.
        crypt = ds.crypt if ds._keys[shard].as_py() else None
        try:
            parquet = open_parquet(source, crypt)  # the footer is decrypted (and its keys unwrapped) once
            meta = parquet.metadata
            views = {}
            for name in [c for c in ds.columns if c == "tokens"] if crypt is None else []:
                view = _zero_copy_view(source, meta, name, ds.token_dtype)
                if view is not None:
                    views[name] = view
            partitions = [c for c in ds.columns if c in ds.manifest.partitions and c not in views]
            rest = [c for c in ds.columns if c not in views and c not in partitions]
            # Decoded on this thread: Arrow's own pool would add threads competing with the loop.
            table = parquet.read(columns=rest, use_threads=False) if rest else None
            if partitions:  # a registered Hive-partitioned file: the values are in its folder names
                values = hive_partitions(url)
                columns: dict[str, Any] = {name: table.column(name) for name in rest} if table is not None else {}
                for name in partitions:
                    kind = pa.int64() if ds.manifest.column_type(name) == "int64" else pa.large_string()
                    columns[name] = partition_array(values.get(name), meta.num_rows, kind)
                table = pa.table(columns)
        except (pa.ArrowException, OSError, PetatrainError) as exc:  # PetatrainError: from the key client
            if crypt is not None:
                raise CorruptDataError(
                    f"shard {url} does not decrypt with {crypt.keyref} (changed, or not this dataset's): {exc}"
                ) from None
            raise CorruptDataError(f"shard unreadable: {url} ({exc})") from None
        if meta.num_rows != ds._rows[shard]:
            raise CorruptDataError(f"shard {url} has {meta.num_rows} rows; the index says {ds._rows[shard]}")
        # One chunk per column: take() on a many-chunk column costs ~10x more per batch.
        return _Shard(table.combine_chunks() if table is not None else None, ds.token_dtype, views)

    def prefetch(self, shards: list[int]) -> None:
        with self.lock:
            for s in shards:
                if s not in self.shards and s not in self.pending:
                    if self.pool is None:
                        self.pool = ThreadPoolExecutor(
                            max_workers=2, thread_name_prefix="petatrain-prefetch", initializer=_lower_priority
                        )
                    self.pending[s] = self.pool.submit(self._load, s)

    def shard(self, shard: int) -> _Shard:
        with self.lock:
            loaded = self.shards.get(shard)
            if loaded is not None:
                self.shards.move_to_end(shard)
                return loaded
            future = self.pending.pop(shard, None)
        loaded = future.result() if future is not None else self._load(shard)  # re-raises fetch errors
        with self.lock:
            self.shards[shard] = loaded
            while len(self.shards) > self.keep:
                self.shards.popitem(last=False)
        return loaded

    def read(self, shards: np.ndarray, rows: np.ndarray) -> dict[str, Any]:
        """The batch of rows (shard, row), in the given order: tensors where the type allows."""
        ds = self.ds
        order = np.argsort(shards, kind="stable")
        sorted_shards = shards[order]
        cuts = np.flatnonzero(sorted_shards[1:] != sorted_shards[:-1]) + 1
        loaded = [self.shard(int(sorted_shards[i])) for i in np.concatenate(([0], cuts))]
        picks = np.split(order, cuts) if len(cuts) else None
        out: dict[str, Any] = {}
        for name in ds.columns:
            if name in loaded[0].arrays:
                if picks is None:  # one shard: a single gather
                    out[name] = torch.from_numpy(loaded[0].arrays[name][rows])
                    continue
                first = loaded[0].arrays[name]
                gathered = np.empty((len(rows), *first.shape[1:]), dtype=first.dtype)
                for shard, pick in zip(loaded, picks, strict=True):
                    gathered[pick] = shard.arrays[name][rows[pick]]
                out[name] = torch.from_numpy(gathered)
            else:
                values: list[Any] = [None] * len(rows)
                for shard, pick in zip(loaded, picks or [np.arange(len(rows))], strict=True):
                    assert shard.table is not None  # a column without a numpy view is in the table
                    taken = _to_python(shard.table.column(name).take(pa.array(rows[pick])), ds.token_dtype, name)
                    for i, v in zip(pick.tolist(), taken, strict=True):
                        values[i] = v
                out[name] = values
        out["index"] = torch.from_numpy(ds._first_row[shards] + rows)
        return out


def _lower_priority() -> None:
    """Run this (prefetch) thread `_PREFETCH_NICE` below the thread that started it (lowering a
    priority needs no privilege)."""
    if sys.platform == "linux":  # elsewhere PRIO_PROCESS with a thread id would name a process
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _PREFETCH_NICE))
        except OSError as exc:  # e.g. a seccomp profile that refuses it: prefetch at normal priority
            log.debug("prefetch thread priority unchanged: %s", exc)


def _shard_url(ds: StreamingDataset, shard: int) -> str:
    return idx.shard_url(ds.root, ds.manifest, ds._paths[shard].as_py())


def _to_python(column: pa.ChunkedArray | pa.Array, token_dtype: np.dtype, name: str) -> list[Any]:
    """Values of a column without a numpy view: strings, variable-length tokens, nullable numbers,
    and source fields as Python values (a binary field stays bytes: only `tokens` holds token ids)."""
    kind = column.type
    if name == "tokens" and (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        return [
            torch.from_numpy(np.frombuffer(v, dtype=token_dtype)) if v is not None else None for v in column.to_pylist()
        ]
    return column.to_pylist()


class StreamingLoader:
    """Batches of a `StreamingDataset`, with the resume state and the data-wait time.

    With `num_workers=0` (as in torch, the default) batches are assembled in the calling
    thread while the dataset's prefetch threads fetch, verify and decode the next shards
    (reads, checksums and Parquet decoding release the GIL): a batch of packed tokens is
    one gather from memory that is already loaded, and nothing crosses a thread or process
    boundary per batch. (A batch-producer thread was measured here: handing batches across
    threads cost ~25% of an epoch's time and overlapped nothing.) With workers, a torch
    DataLoader runs them in processes, which pays off when decoding is Python-heavy (text
    columns). `wait_seconds` is the time the consumer spent waiting for batches (data-wait).
    """

    def __init__(self, dataset: StreamingDataset, *, num_workers: int, pin_memory: bool, prefetch_factor: int):
        self.dataset = dataset
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = max(1, prefetch_factor)
        self._loader = None
        if num_workers:
            self._loader = DataLoader(
                _Batches(dataset),
                batch_size=None,
                num_workers=num_workers,
                pin_memory=pin_memory,
                prefetch_factor=prefetch_factor,
                in_order=True,
            )
        self._consumed = 0
        self.wait_seconds = 0.0
        self.batches = 0

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.dataset.batch_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        source = it = iter(self._loader) if self._loader is not None else self._produce()
        try:
            while True:
                started = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                self.wait_seconds += time.perf_counter() - started
                self._consumed += len(batch["index"])
                self.batches += 1
                yield batch
        finally:
            close = getattr(source, "close", None)  # an early break stops the prefetch threads
            if close:
                close()

    def _produce(self) -> Iterator[dict[str, Any]]:
        for batch in self.dataset.iter_batches():
            if self.pin_memory:
                batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)
        self._consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict(consumed=self._consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self._consumed = 0


class _Batches(IterableDataset):
    def __init__(self, dataset: StreamingDataset):
        self.dataset = dataset

    def __iter__(self):
        worker = get_worker_info()
        return self.dataset.iter_batches(worker.id if worker else 0, worker.num_workers if worker else 1)


def loader(
    dataset: str | StreamingDataset,
    *,
    batch_size: int | None = None,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    prefetch_factor: int = 4,
    **kwargs: Any,
) -> StreamingLoader:
    """A `StreamingLoader` for a dataset URL (kwargs go to `StreamingDataset`) or a dataset."""
    if isinstance(dataset, str):
        dataset = StreamingDataset(dataset, batch_size=batch_size or 1, **kwargs)
    elif batch_size is not None and batch_size != dataset.batch_size:
        raise ValueError(f"batch_size {batch_size} differs from the dataset's batch_size {dataset.batch_size}")
    if num_workers is None:
        num_workers = 0  # in process, shards prefetched by threads; see StreamingLoader
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return StreamingLoader(dataset, num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor)
