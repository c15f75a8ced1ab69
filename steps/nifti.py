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
_INPUT = 1 << 20
_NIFTI2 = (int(540).to_bytes(4, "little"), int(540).to_bytes(4, "big"))


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
        """Voxel values: the stored array when unscaled, else float32, scaled in float64 a
        piece of _CHUNK voxels at a time (a whole float64 copy is 8 bytes a voxel: 8 GiB of
        an int8 volume within max_volume_bytes), the float32 result held to the memory
        first."""
        if not self.scaled:
            return self.data
        limits.check_memory(self.data.size * 4, f"{self.path}: its scaled values (float32)")
        out = np.empty_like(self.data, dtype=np.float32)      # the stored layout
        stored, scaled = self.data.ravel(order="K"), out.ravel(order="K")   # views of both
        for start in range(0, stored.size, _CHUNK):
            piece = stored[start:start + _CHUNK].astype(np.float64)
            scaled[start:start + _CHUNK] = piece * self.slope + self.inter
        return out


def _read(path: Path) -> bytes:
    """The file's bytes. A FIFO, device or directory is refused unopened, and a file larger
    than any volume within ``max_volume_bytes`` could be (gzip adds at most 0.1 %) unread."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise StepError(f"{path}: not a regular file")
        allowed = limits.get("max_volume_bytes")
        if info.st_size > allowed + allowed // 100 + (1 << 20):
            limits.check("max_volume_bytes", info.st_size, f"{path}: file size")
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise StepError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _inflate(raw: bytes, need: int) -> tuple[memoryview, bool]:
    """(up to ``need`` bytes inflated from the gzip file ``raw``, whether more follow them).

    isal inflates the whole volume in one ``decompress(data, max_length)`` call, straight
    into the bytes object that becomes the volume's buffer: it grows one buffer in place.
    CPython's zlib builds such a call's output from blocks and joins them (a copy into
    fresh pages, slower than pieces), so with zlib the output comes in 8 MiB pieces copied
    into one buffer of ``need`` bytes. Each call gets compressed input for its output plus
    1 MiB, since the decoder copies input it leaves unconsumed. Members follow one another.
    A stream that ends early gives fewer bytes; past ``need`` at most one byte is inflated,
    so a bomb behind a small header costs nothing.
    """
    piece = _CHUNK if _zlib is zlib else need
    view, pos, out, total = memoryview(raw), 0, None, 0
    inflate, data = _zlib.decompressobj(31), b""
    while True:
        if inflate.eof:
            rest = inflate.unused_data + view[pos:]     # at the end of a member only
            if not rest.strip(b"\0"):                   # gzip allows zero padding at the end
                return memoryview(out or b"")[:total], False
            inflate, data, view, pos = _zlib.decompressobj(31), b"", memoryview(rest), 0
            continue
        if not data:
            if pos >= len(view):
                if total < need:
                    return memoryview(out or b"")[:total], False
                raise EOFError("the gzip stream ends without its trailer")
            step = min(need - total, piece) + _INPUT
            data, pos = view[pos:pos + step], pos + step
        if total < need:
            part = inflate.decompress(data, min(need - total, piece))
            if out is None and len(part) == need:
                out = part                              # the whole volume in one call
            elif part:
                out = out if out is not None else memoryview(bytearray(need))
                out[total:total + len(part)] = part
            total += len(part)
        elif inflate.decompress(data, 1):
            return memoryview(out), True
        data = inflate.unconsumed_tail


def _check_stream(raw: bytes) -> None:
    """Inflate a gzip file in 8 MiB pieces that are thrown away, up to the volume limit: a
    corrupt stream raises its zlib error here."""
    inflate, budget, data = _zlib.decompressobj(31), limits.get("max_volume_bytes"), raw
    while budget > 0 and data and not inflate.eof:
        budget -= len(inflate.decompress(data, _CHUNK))
        data = inflate.unconsumed_tail


def _header(path: Path, head: bytes) -> nib.Nifti1Header:
    """The parsed header from the first bytes of the file (348 for NIfTI-1, 540 for -2)."""
    if len(head) < 348:
        raise StepError(f"{path}: truncated NIfTI header ({len(head)} bytes)")
    for order in ("little", "big"):
        klass = _HEADER_SIZES.get(int.from_bytes(head[:4], order))
        if klass is not None:
            break
    else:
        raise StepError(f"{path}: not a NIfTI-1/2 file (bad sizeof_hdr)")
    size = 540 if klass is nib.Nifti2Header else 348
    if len(head) < size:
        raise StepError(f"{path}: truncated NIfTI-2 header ({len(head)} bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            header = klass.from_fileobj(io.BytesIO(head[:size]), check=True)
    except Exception as exc:  # nibabel raises HeaderDataError, ValueError, struct errors
        raise StepError(f"{path}: invalid NIfTI header ({exc})") from None
    if header["magic"].item() not in (b"n+1", b"n+2"):
        raise StepError(f"{path}: not a single-file NIfTI (magic {header['magic'].item()!r})")
    return header


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
    declared size held to ``max_volume_bytes`` before the voxels are inflated; a file with
    fewer bytes than declared, or with bytes after the voxel data, is refused. A big-endian
    volume is converted to native byte order.
    """
    path = Path(path)
    raw = _read(path)
    gz = raw[:2] == _GZIP_MAGIC
    try:
        head = bytes(_inflate(raw, 540)[0]) if gz else raw[:540]
        try:
            header = _header(path, head)
            shape, dtype, offset = _layout(path, header, 540 if head[:4] in _NIFTI2 else 348)
        except StepError:
            if gz:
                _check_stream(raw)   # a corrupt gzip is the better explanation
            raise
        need = offset + math.prod(shape) * dtype.itemsize
        buf, more = _inflate(raw, need) if gz else (memoryview(raw)[:need], len(raw) > need)
        if len(buf) < need:
            raise StepError(f"{path}: truncated voxel data ({len(buf)} of {need} bytes)")
        if more:
            raise StepError(f"{path}: bytes left over after the {need} bytes of header and "
                            "voxel data the header declares")
    except (EOFError, ValueError, zlib.error, _zlib.error) as exc:   # isal: IsalError
        raise StepError(f"{path}: truncated or corrupt {'gzip' if gz else 'file'} "
                        f"({exc})") from None
    zooms, affine, slope, inter = _geometry(path, header, len(shape))
    data = np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset, order="F")
    if not dtype.isnative:
        data = data.astype(dtype.newbyteorder("="), order="F")
    data.flags.writeable = False
    return Volume(path=path, data=data, slope=slope, inter=inter, zooms=zooms, affine=affine)
