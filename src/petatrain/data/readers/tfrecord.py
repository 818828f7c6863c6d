"""TFRecord files of `tf.train.Example`s, without TensorFlow: both framing checksums checked."""

from __future__ import annotations

import functools

import google_crc32c

from petatrain.data.readers.base import FileRecords, decode_utf8

# TFRecord framing: uint64 length, masked CRC32C of those 8 bytes, the data, masked CRC32C of the data.
_TFRECORD_HEADER = 12
_CRC_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's checksum: CRC32C rotated right by 15 bits plus a constant (so a CRC over
    data that holds CRCs is not degenerate)."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + _CRC_MASK_DELTA) & 0xFFFFFFFF


def _header_at(data: bytes, pos: int) -> int | None:
    """The record length framed at `pos`, or None where its header's checksum fails."""
    if len(data) - pos < _TFRECORD_HEADER:
        return None
    length = int.from_bytes(data[pos : pos + 8], "little")
    return length if masked_crc32c(data[pos : pos + 8]) == int.from_bytes(data[pos + 8 : pos + 12], "little") else None


def read(data: bytes, text_field: str, max_bytes: int, out: FileRecords) -> None:
    """Records are `tf.train.Example`s; the text is the single bytes value of feature `text_field`.

    Both checksums are checked. A record whose data fails its checksum is rejected and the next
    one read (its length was checked). A header that fails its checksum leaves no trusted
    length: the record is rejected and reading resumes at the next offset that frames a valid
    header, so one flipped byte costs one record, never the rest of the file."""
    view = memoryview(data)
    pos, number = 0, 0
    while pos < len(data):
        length = _header_at(data, pos)
        if length is None:
            if len(data) - pos < _TFRECORD_HEADER:
                out.reject(number, "corrupt_record", f"the file ends inside a record header at byte {pos}", view[pos:])
                return
            resume = _next_header(data, pos + 1)
            detail = f"the record header at byte {pos} fails its CRC32C; resumed at byte {resume}"
            out.reject(number, "corrupt_record", detail, view[pos:resume])
            pos, number = resume, number + 1
            continue
        start, end = pos + _TFRECORD_HEADER, pos + _TFRECORD_HEADER + length
        if end + 4 > len(data):
            out.reject(number, "corrupt_record", f"the file ends inside the record at byte {pos}", view[start:])
            return
        payload = view[start:end]
        if length > max_bytes:
            out.reject(number, "too_long", f"over the {max_bytes}-byte cap that max_chars sets", payload)
        elif masked_crc32c(payload) != int.from_bytes(data[end : end + 4], "little"):
            out.reject(number, "corrupt_record", f"the record at byte {pos} fails its CRC32C", payload)
        else:
            _take_example(number, payload, text_field, out)
        pos, number = end + 4, number + 1


def _next_header(data: bytes, pos: int) -> int:
    """The first offset from `pos` that frames a header with a valid checksum, or the end.

    Only offsets whose length has its top three bytes zero (a record under 1 TiB) are tried,
    found by `bytes.find` at C speed: garbage is skipped without a checksum per byte."""
    while True:
        zeros = data.find(b"\0\0\0", pos + 5)
        if zeros < 0 or zeros - 5 > len(data) - _TFRECORD_HEADER:
            return len(data)
        if _header_at(data, zeros - 5) is not None:
            return zeros - 5
        pos = zeros - 4


def _take_example(number: int, payload: memoryview, text_field: str, out: FileRecords) -> None:
    example = _example_class()()
    try:
        example.ParseFromString(payload)
    except Exception as exc:  # DecodeError, or anything the parser raises on hostile bytes
        out.reject(number, "malformed_record", f"not a tf.train.Example: {exc}"[:200], payload)
        return
    features = example.features.feature
    if text_field not in features:
        out.reject(number, "missing_field", f"no feature {text_field!r}", payload)
        return
    feature = features[text_field]
    kind = feature.WhichOneof("kind")
    if kind != "bytes_list" or len(feature.bytes_list.value) != 1:
        held = f"{len(feature.bytes_list.value)} bytes values" if kind == "bytes_list" else kind or "nothing"
        out.reject(number, "field_not_string", f"feature {text_field!r} holds {held}, not one bytes value", payload)
        return
    text = decode_utf8(number, feature.bytes_list.value[0], out)
    if text is not None:
        out.keep(number, text)


@functools.cache
def _example_class() -> type:
    """`tf.train.Example` (tensorflow/core/example/{example,feature}.proto), built from its
    descriptor in a private pool: no TensorFlow, no generated code, and no clash with a
    TensorFlow that registers the same names in the default pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fd = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="petatrain/tf_example.proto", package="tensorflow", syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> descriptor_pb2.DescriptorProto:
        msg = proto.message_type.add(name=name)
        for field_name, number, label, kind, type_name in fields:
            added = msg.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                added.type_name = type_name
        return msg

    repeated, optional = fd.LABEL_REPEATED, fd.LABEL_OPTIONAL
    message("BytesList", ("value", 1, repeated, fd.TYPE_BYTES, ""))
    message("FloatList", ("value", 1, repeated, fd.TYPE_FLOAT, ""))
    message("Int64List", ("value", 1, repeated, fd.TYPE_INT64, ""))
    feature = message(
        "Feature",
        ("bytes_list", 1, optional, fd.TYPE_MESSAGE, ".tensorflow.BytesList"),
        ("float_list", 2, optional, fd.TYPE_MESSAGE, ".tensorflow.FloatList"),
        ("int64_list", 3, optional, fd.TYPE_MESSAGE, ".tensorflow.Int64List"),
    )
    feature.oneof_decl.add(name="kind")
    for f in feature.field:
        f.oneof_index = 0
    features = message("Features", ("feature", 1, repeated, fd.TYPE_MESSAGE, ".tensorflow.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, label=optional, type=fd.TYPE_STRING)
    entry.field.add(name="value", number=2, label=optional, type=fd.TYPE_MESSAGE, type_name=".tensorflow.Feature")
    message("Example", ("features", 1, optional, fd.TYPE_MESSAGE, ".tensorflow.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))
