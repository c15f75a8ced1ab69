"""Fast, strict NIfTI reading for the preprocess step.

A ``.nii.gz`` is decompressed in one call (``isal`` when installed, else the standard
library; both give the same bytes), the header is parsed by nibabel, and the voxel array is
a zero-copy view of the decompressed buffer in the stored voxel order ``(x, y, z, ...)``
and stored dtype. Scaling (``scl_slope``/``scl_inter``) is applied only when it is not the
identity, exactly as ``nibabel``'s ``get_fdata()`` would, then cast to float32.

Every fault (unreadable, truncated or corrupt file, bad header) is a :class:`StepError` that
names the file.
"""
from __future__ import annotations

import gzip
import io
import zlib
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from steps.errors import StepError

try:  # optional: python-isal decodes gzip about 2x faster than zlib, to the same bytes
    from isal import isal_zlib as _zlib
    GZIP_BACKEND = "isal"
except ImportError:  # pragma: no cover - depends on the environment
    _zlib = zlib
    GZIP_BACKEND = "zlib"

_GZIP_MAGIC = b"\x1f\x8b"
_HEADER_SIZES = {348: nib.Nifti1Header, 540: nib.Nifti2Header}


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


def read_bytes(path: Path) -> bytes:
    """The uncompressed bytes of a ``.nii`` or ``.nii.gz`` file (gzip detected by magic)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise StepError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return _gunzip(raw)
    except (EOFError, OSError, ValueError, zlib.error) as exc:
        raise StepError(f"{path}: truncated or corrupt gzip ({exc})") from None
    except Exception as exc:  # isal raises its own error type for bad streams
        raise StepError(f"{path}: corrupt gzip ({type(exc).__name__}: {exc})") from None


def _gunzip(raw: bytes) -> bytes:
    """Decompress into one buffer sized by the gzip trailer (ISIZE), so the peak is one copy.

    One-shot decoding stops after the first gzip member; when its length is not the trailer's
    size the file has several members and the stream decoder reads them all.
    """
    size = int.from_bytes(raw[-4:], "little")
    out = _zlib.decompress(raw, 31, max(size, 1 << 16))
    if len(out) == size:
        return out
    return gzip.decompress(raw)


def _header(path: Path, buf: bytes) -> nib.Nifti1Header:
    if len(buf) < 348:
        raise StepError(f"{path}: truncated NIfTI header ({len(buf)} bytes)")
    for order in ("little", "big"):
        klass = _HEADER_SIZES.get(int.from_bytes(buf[:4], order))
        if klass is not None:
            break
    else:
        raise StepError(f"{path}: not a NIfTI-1/2 file (bad sizeof_hdr)")
    try:
        header = klass.from_fileobj(io.BytesIO(buf), check=True)
    except Exception as exc:  # nibabel raises HeaderDataError, ValueError, struct errors
        raise StepError(f"{path}: invalid NIfTI header ({exc})") from None
    if header["magic"].item() not in (b"n+1", b"n+2"):
        raise StepError(f"{path}: not a single-file NIfTI (magic {header['magic'].item()!r})")
    return header


def load(path: Path | str) -> Volume:
    """Read ``path`` strictly; the array is a read-only view of the decompressed bytes."""
    path = Path(path)
    buf = read_bytes(path)
    header = _header(path, buf)
    shape = tuple(int(n) for n in header.get_data_shape())
    dtype = header.get_data_dtype()
    offset = int(header.get_data_offset())
    need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(buf) < need:
        raise StepError(f"{path}: truncated voxel data ({len(buf)} of {need} bytes)")
    data = np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset, order="F")
    slope, inter = header.get_slope_inter()
    return Volume(path=path, data=data,
                  slope=1.0 if slope is None else float(slope),
                  inter=0.0 if inter is None else float(inter),
                  zooms=tuple(float(z) for z in header.get_zooms()),
                  affine=header.get_best_affine())
