"""Fast, strict NIfTI reading for the preprocess step.

A ``.nii.gz`` is inflated as far as its header says and no further (``isal`` when installed,
else the standard library; both give the same bytes), the header is parsed by nibabel and
checked, and the voxel array is a view of exactly the declared bytes in the stored voxel
order ``(x, y, z, ...)`` and stored dtype. Scaling (``scl_slope``/``scl_inter``) is applied only when it is not the
identity, exactly as ``nibabel``'s ``get_fdata()`` would, then cast to float32.

Every fault (unreadable, truncated, oversized or corrupt file, bad header) is a
:class:`StepError` that names the file.
"""
from __future__ import annotations

import io
import math
import os
import stat
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import nibabel as nib
import numpy as np

from steps import limits
from steps.errors import StepError

try:  # optional: python-isal decodes gzip about 2x faster than zlib, to the same bytes
    from isal import isal_zlib as _zlib
    GZIP_BACKEND = "isal"
except ImportError:  # pragma: no cover - depends on the environment
    _zlib = zlib
    GZIP_BACKEND = "zlib"

_GZIP_MAGIC = b"\x1f\x8b"
_HEADER_SIZES = {348: nib.Nifti1Header, 540: nib.Nifti2Header}
_CHUNK = 8 << 20


@dataclass
class Volume:
    """One NIfTI file: ``data`` in stored order and dtype, unscaled; scaling kept apart."""
    path: Path
    data: np.ndarray
    slope: float
    inter: float
    zooms: tuple[float, ...]
    affine: np.ndarray

    @property
    def scaled(self) -> bool:
        return (self.slope, self.inter) != (1.0, 0.0)

    def values(self) -> np.ndarray:
        """Voxel values: the stored array when unscaled, else float32 (scaled in float64)."""
        if not self.scaled:
            return self.data
        return (self.data.astype(np.float64) * self.slope + self.inter).astype(np.float32)


def _open(path: Path) -> BinaryIO:
    """Open a regular file for reading; a FIFO, device or directory is refused unopened."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise StepError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise StepError(f"{path}: not a regular file")
    try:
        return open(path, "rb")
    except OSError as exc:
        raise StepError(f"{path}: cannot read ({exc.strerror or exc})") from None


class _Reader:
    """The file's bytes, inflated on the fly when it is gzip (one or several members), read
    only as far as asked: a small header can never make us inflate a large bomb."""

    def __init__(self, handle: BinaryIO):
        self._handle = handle
        self.gzip = handle.read(2) == _GZIP_MAGIC
        handle.seek(0)
        self._inflate = _zlib.decompressobj(31) if self.gzip else None
        self._pending = b""

    def read_into(self, view: memoryview) -> int:
        """Fill ``view`` as far as the data goes; return the bytes written."""
        done = 0
        while done < len(view):
            if not self.gzip:
                count = self._handle.readinto(view[done:])
                if not count:
                    break
                done += count
                continue
            chunk = self._inflated(len(view) - done)
            if not chunk:
                break
            view[done:done + len(chunk)] = chunk
            done += len(chunk)
        return done

    def check_stream(self) -> None:
        """Inflate the rest of a gzip file into a small scratch buffer, up to the volume
        limit: a corrupt stream raises its zlib error here."""
        if not self.gzip:
            return
        scratch = memoryview(bytearray(_CHUNK))
        budget = limits.get("max_volume_bytes")
        while budget > 0 and (count := self.read_into(scratch)):
            budget -= count

    def _inflated(self, most: int) -> bytes:
        while True:
            inflate = self._inflate
            if inflate.eof:
                rest = inflate.unused_data + self._handle.read(_CHUNK)
                if not rest.strip(b"\0"):   # end of file (gzip allows zero padding)
                    return b""
                self._inflate, self._pending = _zlib.decompressobj(31), rest  # next member
                continue
            data = inflate.unconsumed_tail or self._pending or self._handle.read(_CHUNK)
            self._pending = b""
            if not data:
                raise EOFError("compressed stream ended early")
            out = inflate.decompress(data, min(most, _CHUNK))
            if out:
                return out


def _header(path: Path, reader: _Reader) -> tuple[nib.Nifti1Header, bytearray]:
    """The parsed header and its raw bytes (348 for NIfTI-1, 540 for NIfTI-2)."""
    head = bytearray(540)
    size = reader.read_into(memoryview(head)[:348])
    if size < 348:
        raise StepError(f"{path}: truncated NIfTI header ({size} bytes)")
    for order in ("little", "big"):
        klass = _HEADER_SIZES.get(int.from_bytes(head[:4], order))
        if klass is not None:
            break
    else:
        raise StepError(f"{path}: not a NIfTI-1/2 file (bad sizeof_hdr)")
    if klass is nib.Nifti2Header:
        size += reader.read_into(memoryview(head)[348:])
        if size < 540:
            raise StepError(f"{path}: truncated NIfTI-2 header ({size} bytes)")
    head = head[:size]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            header = klass.from_fileobj(io.BytesIO(bytes(head)), check=True)
    except Exception as exc:  # nibabel raises HeaderDataError, ValueError, struct errors
        raise StepError(f"{path}: invalid NIfTI header ({exc})") from None
    if header["magic"].item() not in (b"n+1", b"n+2"):
        raise StepError(f"{path}: not a single-file NIfTI (magic {header['magic'].item()!r})")
    return header, head


def _layout(path: Path, header, header_size: int) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, offset) of the voxel data, each checked before anything is read."""
    dim = [int(d) for d in header["dim"]]
    if not 1 <= dim[0] <= 7 or any(d < 1 for d in dim[1:dim[0] + 1]):
        raise StepError(f"{path}: invalid NIfTI dimensions {dim[:max(1, min(dim[0], 7)) + 1]}"
                        " (dim[0] must be 1..7 and every extent at least 1)")
    shape = tuple(dim[1:dim[0] + 1])
    try:
        dtype = header.get_data_dtype()
    except Exception as exc:  # noqa: BLE001 - an unknown datatype code
        raise StepError(f"{path}: unsupported NIfTI datatype ({exc})") from None
    if dtype.kind not in "iuf" or dtype.fields is not None:
        raise StepError(f"{path}: voxel type {header.get_value_label('datatype')} is not a "
                        "real number type (complex and RGB volumes are not supported)")
    try:
        offset = int(header.get_data_offset())
    except (ValueError, OverflowError):
        raise StepError(f"{path}: vox_offset {header['vox_offset']} is not a byte offset") from None
    if offset < header_size:
        raise StepError(f"{path}: vox_offset {offset} lies inside the header")
    limits.check("max_volume_bytes", offset + math.prod(shape) * dtype.itemsize,
                 f"{path}: NIfTI {'x'.join(map(str, shape))} {dtype.name}")
    return shape, dtype, offset


def _geometry(path: Path, header, ndim: int) -> tuple[tuple[float, ...], np.ndarray, float, float]:
    """(zooms, affine, slope, inter); non-finite or degenerate values are refused."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zooms = tuple(float(z) for z in header.get_zooms())
            affine = header.get_best_affine()
            slope, inter = header.get_slope_inter()
    except Exception as exc:  # noqa: BLE001 - nibabel's HeaderDataError, ValueError, ...
        raise StepError(f"{path}: invalid NIfTI geometry or scaling ({exc})") from None
    if not (all(math.isfinite(z) for z in zooms)
            and all(z > 0 for z in zooms[:min(ndim, 3)])):
        raise StepError(f"{path}: voxel sizes (pixdim) {list(zooms)} must be finite, and "
                        "positive along x, y, z")
    if not np.isfinite(affine).all() or abs(np.linalg.det(affine[:3, :3])) < 1e-12:
        raise StepError(f"{path}: the affine is not finite or is singular "
                        f"({'sform' if header['sform_code'] > 0 else 'qform'})")
    slope = 1.0 if slope is None else float(slope)
    inter = 0.0 if inter is None else float(inter)
    if not (math.isfinite(slope) and math.isfinite(inter)):
        raise StepError(f"{path}: scl_slope {slope} / scl_inter {inter} must be finite")
    return zooms, affine, slope, inter


def load(path: Path | str) -> Volume:
    """Read ``path`` strictly; ``data`` is a read-only array over exactly the declared bytes.

    The header is checked (dimensions, datatype, offset, voxel sizes, affine, scaling) and the
    declared size held to ``max_volume_bytes`` before the voxels are read; a file with fewer
    bytes than declared, or with bytes after the voxel data, is refused. A big-endian volume
    is converted to native byte order.
    """
    path = Path(path)
    with _open(path) as handle:
        try:
            reader = _Reader(handle)
            try:
                header, head = _header(path, reader)
                shape, dtype, offset = _layout(path, header, len(head))
            except StepError:
                reader.check_stream()   # a corrupt gzip is the better explanation
                raise
            buf = bytearray(offset + math.prod(shape) * dtype.itemsize)
            buf[:len(head)] = head
            size = len(head) + reader.read_into(memoryview(buf)[len(head):])
            if size < len(buf):
                raise StepError(f"{path}: truncated voxel data ({size} of {len(buf)} bytes)")
            if reader.read_into(memoryview(bytearray(1))):
                raise StepError(f"{path}: bytes left over after the {len(buf)} bytes of "
                                "header and voxel data the header declares")
        except (EOFError, OSError, ValueError, zlib.error) as exc:
            raise StepError(f"{path}: truncated or corrupt {'gzip' if reader.gzip else 'file'}"
                            f" ({exc})") from None
    zooms, affine, slope, inter = _geometry(path, header, len(shape))
    data = np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset, order="F")
    if not dtype.isnative:
        data = data.astype(dtype.newbyteorder("="), order="F")
    data.flags.writeable = False
    return Volume(path=path, data=data, slope=slope, inter=inter, zooms=zooms, affine=affine)
