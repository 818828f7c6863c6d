"""Bytes handed to Arrow's readers, in memory Arrow owns."""

from __future__ import annotations

import pyarrow as pa


def arrow_reader(data: bytes | memoryview) -> pa.BufferReader:
    """A reader over a copy of `data` that Arrow owns.

    A `pa.BufferReader(bytes)` wraps the Python object, and Arrow's pool threads may drop
    the last reference to it after a read has returned; releasing it then takes the GIL,
    and if the interpreter has begun to exit, the thread is ended inside a C++ destructor:
    the process aborts ("terminate called without an active exception", exit -6) after it
    did all its work (apache/arrow#34314; seen here for `petatrain inspect`, in a core dump:
    a CPU-pool thread in `arrow::py::PyBuffer::~PyBuffer` -> `PyGILState_Ensure`). The copy
    costs a memcpy of the file, small beside decoding it; shards the loader reads are
    memory-mapped, not copied.
    """
    buffer = pa.allocate_buffer(len(data))
    memoryview(buffer).cast("B")[:] = data
    return pa.BufferReader(buffer)
