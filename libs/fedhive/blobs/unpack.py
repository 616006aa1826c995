"""`unpack`: refs -> numpy arrays / torch tensors, checksums verified (DESIGN §5).

One buffer per distinct stored tensor; parallel ranged GETs write straight into it, each part
hashed as soon as it lands while later parts still download. Refs naming the same stored bytes
(the same content key) share one download; each name gets its own array. With a `TensorCache`
a tensor whose checksum is cached is not downloaded: its cached buffer is re-hashed (in a
background thread, while the other tensors download) and reused when it still matches.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedhive.blobs import checksum
from fedhive.blobs.cache import TensorCache
from fedhive.blobs.dtypes import ByteArray, bytes_to_numpy, bytes_to_torch
from fedhive.blobs.port import BlobLocation, RangeFetcher, UrlPreparer
from fedhive.blobs.ref import TensorKind, TensorRef
from fedhive.blobs.transfer import MiB, RangeRead, Segment, as_byte_view, plan_reads, run_reads
from fedhive.errors import ChecksumMismatch, InvalidArgument

# Ranged GETs in flight and their size. Receiving and hashing are CPU work, so more requests
# than cores only add contention: measured on 2 cores (512 MiB in 16 MiB tensors, a fresh
# process, SeaweedFS on the same cores, best of 8): 2 in flight 709 MiB/s, 4 in flight 634;
# 16 MiB parts 709, 8 MiB 672, 32 MiB 691. A tensor's parts are hashed in order on the calling
# thread while the next parts download.
DOWNLOAD_WORKERS = max(2, min(8, os.cpu_count() or 1))
DOWNLOAD_PART_SIZE = 16 * MiB
# Buffers from this size get memory of their own in regular pages (`_new_buffer`).
_OWN_MAPPING_FROM = 4 * MiB


@dataclass
class _Slot:
    """One distinct stored tensor (or one inline ref) and where its bytes come from."""

    ref: TensorRef  # the first ref naming it
    buffer: ByteArray
    hasher: Any
    cached: bool = False


def unpack(
    refs: Sequence[TensorRef],
    fetcher: RangeFetcher,
    *,
    kind: TensorKind | None = None,
    workers: int = DOWNLOAD_WORKERS,
    part_size: int = DOWNLOAD_PART_SIZE,
    cache: TensorCache | None = None,
) -> dict[str, Any]:
    """name -> numpy array / torch tensor (per ref `kind`, or `kind` for all), checksums verified.
    Each array has memory of its own.

    Raises ChecksumMismatch naming the tensor and key when bytes differ from the ref (including
    an object that became shorter), BlobNotFound / BlobAccessDenied from the fetcher.
    """
    names = [ref.name for ref in refs]
    if len(set(names)) != len(names):
        raise InvalidArgument("tensor refs repeat a name", field="name")
    if cache is not None:
        cache.retain({ref.checksum for ref in refs if ref.key})
    slots: list[_Slot] = []
    slot_of: list[int] = []  # per ref: its slot
    stored: dict[tuple[str, int, int, str], int] = {}
    from_cache: set[str] = set()  # checksums whose cached buffer a slot took already
    for ref in refs:
        hasher = checksum.hasher_for(ref.checksum, ref.name)
        if ref.is_inline:
            buffer = np.frombuffer(ref.inline_data, dtype=np.uint8).copy()
            hasher.update(buffer)
            slot_of.append(len(slots))
            slots.append(_Slot(ref, buffer, hasher))
            continue
        identity = (ref.key, ref.offset, ref.length, ref.checksum)
        if identity not in stored:
            cached = None
            if cache is not None and ref.checksum not in from_cache:
                cached = cache.lookup(ref.checksum, ref.length)
            stored[identity] = len(slots)
            if cached is not None:
                from_cache.add(ref.checksum)
                slots.append(_Slot(ref, cached, hasher, cached=True))
            else:
                slots.append(_Slot(ref, _new_buffer(ref.length), hasher))
        slot_of.append(stored[identity])
    wanted = [slot for slot in slots if slot.ref.key and not slot.cached]
    reusable = [slot for slot in slots if slot.cached]
    if reusable:
        with ThreadPoolExecutor(max_workers=1) as side:
            verdict = side.submit(_changed, reusable)  # re-hashed while the rest downloads
            _download(wanted, fetcher, workers, part_size)
            stale = verdict.result()
    else:  # no pool: a small model's every result unpacks inline refs only
        _download(wanted, fetcher, workers, part_size)
        stale = []
    for slot in stale:  # mutated since it was handed out: download it again, into new memory
        slot.cached = False
        slot.buffer = _new_buffer(slot.ref.length)
        slot.hasher = checksum.hasher_for(slot.ref.checksum, slot.ref.name)
    _download(stale, fetcher, workers, part_size)
    for slot in slots:
        if not slot.cached and not checksum.matches(slot.ref.checksum, slot.hasher):
            ref = slot.ref
            raise ChecksumMismatch(
                f"tensor {ref.name!r}: bytes from {'blob ' + ref.key if ref.key else 'inline data'}"
                f" do not match checksum {ref.checksum[:24]}...",
                field=ref.name,
            )
    if cache is not None:
        fetched = sum(slot.ref.length for slot in wanted + stale)
        cache.bytes_fetched += fetched
        cache.bytes_stale += sum(slot.ref.length for slot in stale)
        cache.bytes_reused += sum(slot.ref.length for slot in slots if slot.cached)
        cache.replace({slot.ref.checksum: slot.buffer for slot in slots if slot.ref.key})
    handed: set[int] = set()
    out: dict[str, Any] = {}
    for ref, index in zip(refs, slot_of, strict=True):
        buffer = slots[index].buffer
        if index in handed:  # another name for the same bytes: its own memory
            buffer = buffer.copy()
        handed.add(index)
        out[ref.name] = _materialise(buffer, ref, kind or ref.kind)
    return out


def inline_values(ref: TensorRef) -> Any:
    """An inline ref's bytes as the numpy array they hold in stored form (bfloat16: uint16
    bits): a read-only view, not checked against the ref's checksum. For a reader that takes
    them as values whatever their label says, as the server's sums do: they are the bytes the
    broker-verified sender sent, and a label matters only where the bytes are trusted by it
    (passed on unread, or stored under their content key; both check it)."""
    view = np.frombuffer(ref.inline_data, dtype=np.uint8)
    view.flags.writeable = False
    return bytes_to_numpy(view, ref.dtype, ref.shape)


def _changed(slots: list[_Slot]) -> list[_Slot]:
    """The cached slots whose buffers no longer hash to their checksum."""
    stale = []
    for slot in slots:
        slot.hasher.update(slot.buffer)
        if not checksum.matches(slot.ref.checksum, slot.hasher):
            stale.append(slot)
    return stale


def _new_buffer(length: int) -> ByteArray:
    """Memory for one downloaded tensor, in regular pages. numpy asks for transparent huge
    pages for arrays from 4 MiB; on VMs that hand freed memory back to the host
    (virtio-balloon free page reporting, as on this project's machines) a fresh huge page is
    costly to fault in: the kernel's page clearing dominated the profile. Measured on 2 cores,
    a fresh process receiving 512 MiB (sha256 included): 1.07-1.13 CPU-s into numpy's buffers,
    0.71-0.76 into these, as for a boto3 download's bytes. A private anonymous mapping per
    large buffer keeps the memory the tensor's own: it goes back when the array is dropped."""
    if length < _OWN_MAPPING_FROM or not hasattr(mmap, "MAP_PRIVATE"):
        return np.empty(length, dtype=np.uint8)
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype=np.uint8)


def _download(slots: list[_Slot], fetcher: RangeFetcher, workers: int, part_size: int) -> None:
    if not slots:
        return
    wheres = [BlobLocation(s.ref.key, s.ref.url, s.ref.url_expires_at_ms) for s in slots]
    if isinstance(fetcher, UrlPreparer):
        fetcher.prepare(wheres)
    segments = [
        Segment(where, slot.ref.offset, as_byte_view(slot.buffer), tag)
        for tag, (slot, where) in enumerate(zip(slots, wheres, strict=True))
    ]

    def hash_landed(read: RangeRead) -> None:
        for piece, tag in read.pieces:
            slots[tag].hasher.update(piece)

    try:
        run_reads(fetcher, plan_reads(segments, part_size), workers, hash_landed)
    except InvalidArgument as err:
        victim = next((s.ref for s in slots if s.ref.key == err.field), None)
        if victim is None:
            raise
        raise ChecksumMismatch(
            f"tensor {victim.name!r}: blob {victim.key} no longer holds the ref's byte range",
            field=victim.name,
        ) from err


def _materialise(buffer: ByteArray, ref: TensorRef, kind: TensorKind) -> Any:
    if kind is TensorKind.TORCH:
        return bytes_to_torch(buffer, ref.dtype, ref.shape)
    return bytes_to_numpy(buffer, ref.dtype, ref.shape)
