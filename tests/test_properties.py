"""Property-based tests: hostile NIfTI files and tar archives fail cleanly or load safely.

Two loaders take bytes from outside: :func:`steps.nifti.load` and
:func:`steps.download.extract_tar`. For any input, each must either succeed with a result
that keeps the documented invariants, or raise :class:`StepError` with a one-line message.
Any other exception, a multi-line message, or an unsafe result is a failure.

Every property runs with small size limits (``UNET_MAX_*`` set in ``os.environ`` for the
duration of one example), so a loader that honours them never allocates or writes much.
Examples are derandomized and there is no example database: CI sees the same inputs.

Besides the two properties: a tracemalloc property (a forged gzip trailer or a gzip bomb
costs load() no more memory than the honest file), and parametrized tables that run the same
checks on fixed inputs: falsifying examples found while writing the properties, and valid
inputs that must load.
"""
from __future__ import annotations

import gzip
import io
import math
import os
import random
import re
import stat
import struct
import tarfile
import tempfile
import tracemalloc
import unicodedata
import zlib
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import nibabel as nib
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from steps import download, nifti
from steps.errors import StepError
from tests.conftest import GZIP_BACKENDS, gzip_decoder

# hypothesis imports libcst to write its patch file after a failure; libcst warns on import
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:libcst.*")

KiB, MiB = 1 << 10, 1 << 20
# Scratch files go to tmpfs when there is one: unlinking thousands of tiny files on a disk
# mounted with ``discard`` costs more than the tests themselves.
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None

SETTINGS = dict(derandomize=True, database=None, deadline=2000, print_blob=False,
                report_multiple_bugs=False,
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextmanager
def limits(**values: int):
    """Set ``UNET_<NAME>`` for the limits named (lower case) while the block runs."""
    env = {f"UNET_{name.upper()}": str(value) for name, value in values.items()}
    with mock.patch.dict(os.environ, env):
        yield


def assert_one_line(exc: StepError) -> None:
    """A StepError message is one non-empty line with no control or line-break characters."""
    message = str(exc)
    assert message.strip(), f"empty StepError message: {exc!r}"
    bad = [c for c in message if unicodedata.category(c) in ("Cc", "Zl", "Zp")]
    assert not bad, f"StepError message has control/line-break characters {bad!r}: {message!r}"


# =============================================================================== NIfTI-1

# code -> (numpy dtype string or None when numpy has no such type, bytes per voxel)
DATATYPES = {2: ("u1", 1), 4: ("i2", 2), 8: ("i4", 4), 16: ("f4", 4), 64: ("f8", 8),
             256: ("i1", 1), 512: ("u2", 2), 768: ("u4", 4), 1024: ("i8", 8),
             1280: ("u8", 8), 32: ("c8", 8), 1792: ("c16", 16), 128: (None, 3),
             2304: (None, 4), 1536: (None, 16), 2048: (None, 32), 1: (None, 1)}
BOGUS_DATATYPES = [0, 3, 7, 255, 999, 4096, -1, 32767, -32768]
if "float16" in nib.nifti1.data_type_codes.value_set("label"):  # not in nibabel 5.4
    DATATYPES[int(nib.nifti1.data_type_codes.code["float16"])] = ("f2", 2)

BAD_FLOATS = [0.0, -0.0, -1.0, -2.5, math.nan, math.inf, -math.inf, 1e-45, 3e38]
good_float = st.floats(0.25, 4.0, width=32)
bad_float = st.sampled_from(BAD_FLOATS)
finite = st.floats(-100, 100, width=32)
small_dim = st.integers(1, 5)
bad_dim = st.sampled_from([0, -1, -32768, 32767, 1000, 256])
good_ndim = st.integers(1, 4)
bad_ndim = st.sampled_from([0, 5, 6, 7, 8, -1, -32768, 32767])

# Each header field: (strategy of good values, strategy of bad values). A generated file
# corrupts each field with odds of about 1 in 12 (so one or two fields, often none): both the
# success and the failure paths are explored, and a falsifying example shrinks to the fewest
# corrupted fields.
FIELDS = {
    "code": (st.sampled_from([2, 4, 8, 16, 64, 256, 512, 768, 1024, 1280]),
             st.sampled_from([32, 1792, 128, 2304, 1536, 2048, 1] + BOGUS_DATATYPES)),
    "dim": (st.tuples(good_ndim, *[small_dim] * 7),
            st.tuples(st.one_of(good_ndim, bad_ndim),
                      *[st.one_of(small_dim, bad_dim, bad_dim)] * 7)),
    "pixdim": (st.tuples(st.sampled_from([1.0, -1.0]), *[good_float] * 7),
               st.tuples(st.sampled_from([1.0, -1.0, 0.0, math.nan, 2.0]),
                         *[st.one_of(good_float, bad_float)] * 7)),
    "bitpix": (st.just("right"), st.sampled_from([0, 7, -8, 999])),
    "sizeof_hdr": (st.just(348), st.sampled_from([540, 0, 347, 0x5C010000])),
    "magic": (st.just(b"n+1"), st.sampled_from([b"ni1", b"n+2", b"xyz", b""])),
    "qform_code": (st.sampled_from([0, 1, 2, 3, 4]), st.sampled_from([5, -1, 255])),
    "sform_code": (st.sampled_from([0, 0, 1, 2, 3, 4]), st.sampled_from([5, -1, 255])),
    "quatern": (st.tuples(*[st.floats(-0.5, 0.5, width=32)] * 3),
                st.tuples(*[st.sampled_from([0.0, 1.0, -1.0, 2.0, math.nan, math.inf])] * 3)),
    "qoffset": (st.tuples(*[finite] * 3), st.just((math.nan, 0.0, math.inf))),
    "srow": (st.one_of(st.just("from-pixdim"), st.tuples(*[finite] * 12)),
             st.sampled_from(["zeros", "nan", "inf", "rank-deficient", "huge"])),
    "slope": (st.sampled_from([1.0, 2.5, 0.0]),
              st.sampled_from([math.nan, math.inf, -1.0, 1e-45, 3e38])),
    "inter": (st.sampled_from([0.0, -3.0]), st.sampled_from([math.nan, math.inf, -math.inf, 3e38])),
    "vox_offset": (st.sampled_from([352.0, 368.0]),
                   st.sampled_from([0.0, 348.0, 351.0, 353.0, 352.5, -16.0, math.nan,
                                    math.inf, 1e30, 2.0 ** 31])),
    "extension": (st.sampled_from([None, "valid"]),
                  st.sampled_from(["esize-0", "esize-7", "esize-negative", "esize-huge"])),
    "body": (st.just("exact"), st.sampled_from(["short", "trailing"])),
    "compress": (st.sampled_from(["none", "gzip", "gzip-2-members"]),
                 st.sampled_from(["gzip-truncated", "gzip-bad-isize"])),
}


@st.composite
def nifti_files(draw):
    """The spec of a NIfTI-1 file (see build_nifti): every header field good except the few
    drawn to be corrupted; either byte order; plain or gzip."""
    corrupt = [name for name in sorted(FIELDS) if draw(st.integers(0, 11)) == 11]  # ~1/12
    spec = {name: draw(FIELDS[name][name in corrupt]) for name in FIELDS}
    if spec["extension"] is not None and "vox_offset" not in corrupt:
        spec["vox_offset"] = 368.0  # room for the 16-byte extension before the voxels
    spec.update(corrupt=corrupt, endian=draw(st.sampled_from(["<", ">"])),
                cut=draw(st.integers(1, 64)), seed=draw(st.integers(0, 2 ** 16)))
    return spec


def build_nifti(spec: dict) -> bytes:
    """Header via nibabel's Nifti1Header; every field then written raw (no validation)."""
    e = spec["endian"]
    hdr = nib.Nifti1Header(endianness=e)
    numpy_code, itemsize = DATATYPES.get(spec["code"], (None, 4))
    if numpy_code is not None:
        hdr.set_data_dtype(np.dtype(numpy_code))
    hdr["datatype"] = spec["code"]  # raw write: bogus codes go through
    hdr["bitpix"] = itemsize * 8 if spec["bitpix"] == "right" else spec["bitpix"]
    hdr["dim"] = spec["dim"]
    hdr["pixdim"] = spec["pixdim"]
    hdr["sizeof_hdr"] = spec["sizeof_hdr"]
    hdr["magic"] = spec["magic"]
    hdr["qform_code"], hdr["sform_code"] = spec["qform_code"], spec["sform_code"]
    hdr["quatern_b"], hdr["quatern_c"], hdr["quatern_d"] = spec["quatern"]
    hdr["qoffset_x"], hdr["qoffset_y"], hdr["qoffset_z"] = spec["qoffset"]
    rows = srow_values(spec["srow"], spec["pixdim"])
    hdr["srow_x"], hdr["srow_y"], hdr["srow_z"] = rows[0:4], rows[4:8], rows[8:12]
    hdr["scl_slope"], hdr["scl_inter"] = spec["slope"], spec["inter"]
    hdr["vox_offset"] = spec["vox_offset"]
    head = hdr.binaryblock
    assert len(head) == 348
    ext = extension_bytes(spec["extension"], e)
    offset = spec["vox_offset"]
    pad = int(offset) - 348 - len(ext) if math.isfinite(offset) and 352 <= offset <= 4096 else 0
    content = head + ext + b"\0" * max(pad, 0) + body_bytes(spec)
    return compress(content, spec["compress"])


def srow_values(kind, pix) -> list[float]:
    """The 12 sform values: drawn ones, or a named (possibly degenerate) matrix."""
    if isinstance(kind, tuple):
        return list(kind)
    eye = [pix[1], 0, 0, -10, 0, pix[2], 0, 12, 0, 0, pix[3], 5]
    return {"from-pixdim": eye, "zeros": [0.0] * 12,
            "nan": eye[:5] + [math.nan] + eye[6:], "inf": eye[:10] + [math.inf, 5],
            "rank-deficient": [1, 2, 3, 0, 2, 4, 6, 0, 0, 0, 1, 0],
            "huge": [3e38, 0, 0, 0, 0, 3e38, 0, 0, 0, 0, 3e38, 0]}[kind]


def extension_bytes(kind, e: str) -> bytes:
    """The 4 extender bytes after the header, plus one extension (esize, ecode=4, data)."""
    if kind is None:
        return b"\0\0\0\0"
    esize = {"valid": 16, "esize-0": 0, "esize-7": 7, "esize-negative": -16,
             "esize-huge": 2 ** 31 - 1}[kind]
    return b"\1\0\0\0" + struct.pack(f"{e}ii", esize, 4) + b"extdata!"


def declared_nbytes(spec: dict) -> int | None:
    """Voxel bytes the header declares, or None when its dims are not a valid shape."""
    shape = declared_shape(spec)
    if shape is None:
        return None
    return math.prod(shape) * DATATYPES.get(spec["code"], (None, 4))[1]


def declared_shape(spec: dict) -> tuple[int, ...] | None:
    """``dim[1:dim[0]+1]`` when dim[0] is 1..7 and every extent is at least 1, else None."""
    ndim = spec["dim"][0]
    if not 1 <= ndim <= 7:
        return None
    shape = tuple(spec["dim"][1:ndim + 1])
    return shape if all(n >= 1 for n in shape) else None


def body_bytes(spec: dict) -> bytes:
    """The voxel bytes: exactly as declared (when small), short, or with trailing bytes."""
    n = declared_nbytes(spec)
    n = n if n is not None and n <= 64 * KiB else 256
    if spec["body"] == "short":
        n = max(0, n - spec["cut"])
    elif spec["body"] == "trailing":
        n += spec["cut"]
    return random.Random(spec["seed"]).randbytes(n)


def compress(content: bytes, how: str) -> bytes:
    """Plain, gzip, two concatenated gzip members, truncated gzip, or a forged ISIZE."""
    if how == "none":
        return content
    if how == "gzip-2-members":
        half = len(content) // 2
        return gzip.compress(content[:half], mtime=0) + gzip.compress(content[half:], mtime=0)
    packed = gzip.compress(content, compresslevel=1, mtime=0)
    if how == "gzip-truncated":
        return packed[: len(packed) * 2 // 3]
    if how == "gzip-bad-isize":
        return packed[:-4] + struct.pack("<I", 0xFFFFFFF0)
    return packed


def expected_values(spec: dict, raw: bytes) -> np.ndarray | None:
    """The voxels the header describes, read straight from the generated bytes, or None when
    the header is not one a reader should take at face value (offset, magic, type)."""
    shape, offset = declared_shape(spec), spec["vox_offset"]
    numpy_code = DATATYPES.get(spec["code"], (None, 0))[0]
    if (shape is None or numpy_code is None or spec["magic"] != b"n+1"
            or not (math.isfinite(offset) and offset == int(offset) and offset >= 352)):
        return None
    content = raw if spec["compress"] == "none" else gzip.decompress(raw)
    dtype = np.dtype(numpy_code).newbyteorder(spec["endian"])
    count = math.prod(shape)
    if int(offset) + count * dtype.itemsize > len(content):
        return None
    flat = np.frombuffer(content, dtype=dtype, count=count, offset=int(offset))
    return flat.reshape(shape, order="F")


def check_volume(volume, spec: dict, raw: bytes, limit: int) -> None:
    """The invariants of a successfully loaded volume."""
    assert spec["compress"] not in ("gzip-truncated", "gzip-bad-isize"), \
        f"loaded a corrupt gzip ({spec['compress']})"
    data = volume.data
    assert isinstance(data, np.ndarray), type(data)
    assert data.dtype.kind in "biuf", f"non-real voxel dtype {data.dtype} (code {spec['code']})"
    shape = declared_shape(spec)
    assert shape is not None, f"loaded a header with invalid dims {spec['dim']} as {data.shape}"
    assert data.shape == shape, f"shape {data.shape} != header dims {shape}"
    assert data.nbytes <= limit, f"{data.nbytes} voxel bytes over the limit {limit}"
    values = data.astype(np.float64)  # readable, whatever the byte order
    expected = expected_values(spec, raw)
    if expected is not None:
        assert np.array_equal(values, expected.astype(np.float64), equal_nan=True), \
            "voxel values differ from the bytes the header points at"
    zooms = tuple(volume.zooms)
    # pixdim beyond x, y, z (time, channel) may be 0 in valid files; it must still be finite.
    assert zooms and all(math.isfinite(z) for z in zooms), f"bad zooms {zooms}"
    assert all(z > 0 for z in zooms[:3]), f"bad spatial zooms {zooms}"
    affine = np.asarray(volume.affine, dtype=np.float64)
    assert affine.shape == (4, 4), affine.shape
    assert np.isfinite(affine).all(), f"non-finite affine\n{affine}"
    det = np.linalg.det(affine[:3, :3])
    assert det != 0 and not math.isnan(det), f"singular affine (det {det})\n{affine}"
    assert math.isfinite(volume.slope) and math.isfinite(volume.inter), \
        f"non-finite scaling slope={volume.slope} inter={volume.inter}"


def nifti_outcome(spec: dict, raw: bytes, limit: int) -> str:
    """Write ``raw``, load it under ``limit``, check the invariants; return what happened."""
    suffix = ".nii" if spec["compress"] == "none" else ".nii.gz"
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp, limits(max_volume_bytes=limit):
        path = Path(tmp) / f"case{suffix}"
        path.write_bytes(raw)
        try:
            volume = nifti.load(path)
        except StepError as exc:
            assert_one_line(exc)
            return outcome(exc)
        check_volume(volume, spec, raw, limit)
    return "loaded"


def outcome(exc: StepError) -> str:
    """A short label of a StepError for hypothesis statistics (first words, no numbers)."""
    words = re.sub(r"[^A-Za-z ]+", " ", str(exc).split(": ", 1)[-1]).split()
    return "StepError: " + " ".join(words[:4])


@pytest.mark.slow
@pytest.mark.parametrize("backend", GZIP_BACKENDS)
@settings(max_examples=600, **SETTINGS)
@given(nifti_files(), st.sampled_from([MiB, 4 * KiB, 1 * KiB]))
def test_nifti_load_is_valid_or_one_line_steperror(backend, spec, limit):
    """Any NIfTI-1 header/body, through each gzip decoder: load() returns a sane Volume or
    raises a one-line StepError."""
    with gzip_decoder(backend):
        event(nifti_outcome(spec, build_nifti(spec), limit))


def nifti_spec(**fields) -> dict:
    """A valid 2x2x2 uint8 little-endian .nii spec, with ``fields`` replaced."""
    spec = dict(code=2, dim=(3, 2, 2, 2, 1, 1, 1, 1), pixdim=(1.0,) * 8, bitpix="right",
                sizeof_hdr=348, magic=b"n+1", qform_code=0, sform_code=0,
                quatern=(0.0, 0.0, 0.0), qoffset=(0.0, 0.0, 0.0), srow="from-pixdim",
                slope=1.0, inter=0.0, vox_offset=352.0, extension=None, body="exact",
                compress="none", corrupt=[], endian="<", cut=1, seed=0)
    spec.update(fields)
    return spec


# Falsifying examples seen while writing the property (kept so that they always run) and a
# few valid files the loader must accept.
NIFTI_CASES = {
    "valid": nifti_spec(),
    "big-endian-int16-gzip": nifti_spec(endian=">", code=4, compress="gzip"),
    "gzip-two-members": nifti_spec(compress="gzip-2-members"),
    "quatern-norm-over-1": nifti_spec(qform_code=1, quatern=(1.0, 1.0, 0.0)),
    "quatern-inf": nifti_spec(qform_code=1, quatern=(math.inf, 0.0, 0.0)),
    "vox-offset-inf": nifti_spec(vox_offset=math.inf),
    "vox-offset-nan": nifti_spec(vox_offset=math.nan),
    "inter-inf": nifti_spec(inter=math.inf),
    "inter-nan": nifti_spec(inter=math.nan),
    "pixdim4-nan": nifti_spec(dim=(4, 2, 2, 2, 2, 1, 1, 1), pixdim=(1.0,) * 4 + (math.nan,) * 4),
    "dims-overflow-int64": nifti_spec(dim=(7,) + (32767,) * 7),
    "gzip-bad-isize": nifti_spec(compress="gzip-bad-isize"),
    "complex64": nifti_spec(code=32),
}


@pytest.mark.parametrize("name", sorted(NIFTI_CASES))
def test_nifti_known_cases(name, gzip_backend):
    """The property on fixed headers: earlier falsifying examples and valid files."""
    spec = NIFTI_CASES[name]
    result = nifti_outcome(spec, build_nifti(spec), MiB)
    if name in ("valid", "big-endian-int16-gzip", "gzip-two-members"):
        assert result == "loaded", result


def _zero_bomb(prefix: bytes, zeros: int) -> bytes:
    """gzip of ``prefix`` followed by ``zeros`` zero bytes, built without holding them all."""
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)
    chunk = bytes(MiB)
    parts = [packer.compress(prefix)]
    for start in range(0, zeros, MiB):
        parts.append(packer.compress(chunk[: min(MiB, zeros - start)]))
    parts.append(packer.flush())
    return b"".join(parts)


def _traced_load(raw: bytes, tmp: str, name: str) -> tuple[int, object]:
    """(peak bytes traced by tracemalloc, Volume or the StepError) for one load() call."""
    path = Path(tmp) / name
    path.write_bytes(raw)
    tracemalloc.start()
    try:
        try:
            result = nifti.load(path)
        except StepError as exc:
            assert_one_line(exc)
            result = exc
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("backend", GZIP_BACKENDS)
@settings(max_examples=20, **SETTINGS)
@given(st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8)),
       st.sampled_from(["isize-huge", "isize-random", "bomb"]),
       st.sampled_from([8, 32]), st.integers(0, 2 ** 32 - 1))
def test_nifti_gzip_memory_is_bounded(backend, shape, kind, bomb_mib, isize):
    """A forged gzip trailer (ISIZE) or a small .nii.gz that inflates to many MiB past its
    declared voxels costs load() at most 2 x max_volume_bytes more peak memory (tracemalloc)
    than the honest file with the same header, through each gzip decoder."""
    limit = MiB
    hdr = nib.Nifti1Header()
    hdr.set_data_shape(shape)
    hdr.set_data_dtype(np.uint8)
    hdr["vox_offset"] = 352
    content = hdr.binaryblock + b"\0" * 4 + bytes(math.prod(shape))
    honest = gzip.compress(content, mtime=0)
    if kind == "bomb":
        raw = _zero_bomb(content, bomb_mib * MiB)
    else:
        raw = honest[:-4] + struct.pack("<I", 0xFFFFFFFF if kind == "isize-huge" else isize)
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp, limits(max_volume_bytes=limit), \
            gzip_decoder(backend):
        base, volume = _traced_load(honest, tmp, "honest.nii.gz")
        assert not isinstance(volume, StepError), f"honest file refused: {volume}"
        peak, _ = _traced_load(raw, tmp, f"{kind}.nii.gz")
    assert peak <= base + 2 * limit, \
        f"{kind}: load() peaked at {peak} bytes traced, honest file {base}, limit {limit}"


# =============================================================================== tar

SAFE_COMPONENTS = ["a", "b", "Task01_BrainTumour", "imagesTr", "BRATS_001.nii.gz",
                   "dataset.json", "ü", "日本語", "._x", "._BRATS_001.nii.gz", "__MACOSX",
                   ".DS_Store"]
HOSTILE_COMPONENTS = ["outside", ".", "..", "", "a\\b", "..\\..\\x", "C:", "C:\\x",
                      "a" * 100, "b" * 300, "a\nb", "tab\there", "esc\x1b[0m", "cr\r", " ",
                      "x\u2028y"]
HOSTILE_PREFIXES = ["", "/", "//", "./", "{OUT}/", "\\", "C:/", "../"]
SAFE_TYPES = [tarfile.REGTYPE, tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.AREGTYPE,
              tarfile.CONTTYPE]
HOSTILE_TYPES = [tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                 tarfile.FIFOTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.GNUTYPE_SPARSE,
                 b"Z", "pax-sparse"]
LINKNAMES = ["x", "a", "../../outside/y", "/etc/passwd", "{OUT}/z"]
FORMATS = [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]

join_name = lambda prefix, parts, slash: prefix + "/".join(parts) + slash  # noqa: E731
safe_names = st.builds(join_name, st.sampled_from(["", "./"]),
                       st.lists(st.sampled_from(SAFE_COMPONENTS), min_size=1, max_size=3),
                       st.sampled_from(["", "/"]))
hostile_names = st.builds(
    join_name, st.sampled_from(HOSTILE_PREFIXES),
    st.lists(st.sampled_from(SAFE_COMPONENTS + HOSTILE_COMPONENTS), min_size=1, max_size=4),
    st.sampled_from(["", "/"]))
sizes = st.one_of(st.integers(0, 600), st.integers(0, 5000))
# (name, type, size, linkname); a hostile member has a hostile name or type (or both)
safe_members = st.tuples(safe_names, st.sampled_from(SAFE_TYPES), sizes, st.just(""))
hostile_members = st.tuples(st.one_of(safe_names, hostile_names),
                            st.sampled_from(SAFE_TYPES + HOSTILE_TYPES), sizes,
                            st.sampled_from(LINKNAMES))


@st.composite
def tar_archives(draw):
    """Archive description: safe members with a few hostile ones mixed in (often none),
    extra small files (for the count limit), format, gzip or not, and damage (tar or gzip
    stream truncated, end-of-archive blocks dropped, trailing junk)."""
    members = draw(st.lists(safe_members, max_size=6))
    for member in draw(st.lists(hostile_members, max_size=2)):
        members.insert(draw(st.integers(0, len(members))), member)
    return dict(
        members=members,
        padding=draw(st.sampled_from([0, 0, 0, 5, 40])),
        format=draw(st.sampled_from(FORMATS)),
        gzip=draw(st.booleans()),
        damage=draw(st.sampled_from(["none", "none", "none", "cut", "cut-gzip", "no-eof",
                                     "junk"])),
        cut=draw(st.floats(0.05, 0.95)),
    )


def build_tar(spec: dict, outside: Path) -> bytes:
    """Write the described archive with tarfile; a member its format cannot hold is written
    in PAX instead (the format of the whole archive then varies by member)."""
    buf = io.BytesIO()
    items = [(n.replace("{OUT}", str(outside)), t, s, ln.replace("{OUT}", str(outside)))
             for n, t, s, ln in spec["members"]]
    items += [(f"pad/{i}.txt", tarfile.REGTYPE, 3, "") for i in range(spec["padding"])]
    fmt = spec["format"]
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, kind, size, linkname in items:
            info, data = tar_member(name, kind, size, linkname)
            try:
                block = info.tobuf(fmt, tar.encoding, tar.errors)
            except ValueError:  # e.g. a name too long for USTAR
                block = info.tobuf(tarfile.PAX_FORMAT, tar.encoding, tar.errors)
            padded = data + b"\0" * (-len(data) % 512)
            tar.fileobj.write(block + padded)
            tar.offset += len(block) + len(padded)
    raw = buf.getvalue()
    if spec["damage"] == "cut":
        raw = raw[: int(len(raw) * spec["cut"])]
    elif spec["damage"] == "no-eof":
        raw = raw.rstrip(b"\0")
    elif spec["damage"] == "junk":
        raw += random.Random(len(raw)).randbytes(700)
    if spec["gzip"]:
        raw = gzip.compress(raw, compresslevel=1, mtime=0)
        if spec["damage"] == "cut-gzip":
            raw = raw[: int(len(raw) * spec["cut"])]
    return raw


def tar_member(name, kind, size, linkname) -> tuple[tarfile.TarInfo, bytes]:
    """The TarInfo and data of one generated member."""
    info = tarfile.TarInfo(name)
    info.mtime, info.mode = 0, 0o644
    if kind == "pax-sparse":  # GNU sparse 1.0 in PAX: a 512-byte map that inflates to `size`
        data = b"1\n0\n0\n".ljust(512, b"\0")
        info.size = len(data)
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                            "GNU.sparse.name": name, "GNU.sparse.realsize": str(size * 1000)}
        info.name = "GNUSparseFile.0/" + name.rsplit("/", 1)[-1]
        return info, data
    info.type = kind
    if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        info.linkname = linkname
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    if kind in tarfile.REGULAR_TYPES or kind == b"Z":
        info.size = size
        return info, bytes([size % 251]) * size
    return info, b""


def check_tree(dest: Path) -> list[Path]:
    """Every path under ``dest`` is a regular file or directory inside it; return the files."""
    files = []
    root = os.path.realpath(dest)
    for dirpath, dirnames, filenames in os.walk(dest):
        for entry in dirnames + filenames:
            path = Path(dirpath, entry)
            mode = os.lstat(path).st_mode
            assert stat.S_ISREG(mode) or stat.S_ISDIR(mode), \
                f"{path.relative_to(dest)!s} is not a regular file or directory ({oct(mode)})"
            assert os.path.realpath(path).startswith(root + os.sep), f"{path} escapes {dest}"
            if stat.S_ISREG(mode):
                files.append(path)
    return files


def tar_outcome(spec: dict, max_members: int, max_member: int, max_total: int) -> str:
    """Build the archive, extract it under the limits, check the invariants; return what
    happened. Layout: ``root/dest`` is extracted into, ``root/outside`` must stay empty."""
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp, limits(
            max_members=max_members, max_member_bytes=max_member, max_extract_bytes=max_total):
        root = Path(tmp, "root")
        dest, outside = root / "dest", root / "outside"
        outside.mkdir(parents=True)
        archive = Path(tmp, "in", "data.tar.gz" if spec["gzip"] else "data.tar")
        archive.parent.mkdir()
        archive.write_bytes(build_tar(spec, outside))
        error = None
        try:
            count = download.extract_tar(archive, dest, progress=False)
        except StepError as exc:
            error = exc
        beside = sorted(p.name for p in root.iterdir())
        assert beside in (["dest", "outside"], ["outside"]), f"written beside dest: {beside}"
        assert not any(outside.iterdir()), f"written outside dest: {list(outside.iterdir())}"
        files = check_tree(dest) if dest.exists() else []
        if error is not None:
            assert_one_line(error)
            return outcome(error)
        assert isinstance(count, int) and count >= 0, count
        sizes = [f.stat().st_size for f in files]
        assert len(files) <= max_members, f"{len(files)} files over max_members={max_members}"
        assert all(s <= max_member for s in sizes), \
            f"a file of {max(sizes)} bytes over max_member_bytes={max_member}"
        assert sum(sizes) <= max_total, f"{sum(sizes)} bytes over max_extract_bytes={max_total}"
        dropped = [f for f in files
                   if f.name.startswith("._") or "__MACOSX" in f.relative_to(dest).parts]
        assert not dropped, f"macOS metadata extracted: {dropped}"
    return "extracted"


@pytest.mark.slow
@settings(max_examples=250, **SETTINGS)
@given(tar_archives(),
       st.sampled_from([1000, 3, 10]),            # max_members
       st.sampled_from([MiB, 1 * KiB, 4 * KiB]),  # max_member_bytes
       st.sampled_from([MiB, 2 * KiB, 8 * KiB]))  # max_extract_bytes
def test_extract_tar_is_safe_or_one_line_steperror(spec, max_members, max_member, max_total):
    """Any tar (GNU/PAX/USTAR, gzip or not, damaged or not): extract_tar() leaves only regular
    files and directories inside dest within the limits, or raises a one-line StepError;
    either way nothing appears outside dest."""
    event(tar_outcome(spec, max_members, max_member, max_total))


def tar_spec(*members, padding=0, fmt=tarfile.PAX_FORMAT, gz=False, damage="none", cut=0.5):
    """An archive spec of ``members`` (name, type, size, linkname)."""
    return dict(members=list(members), padding=padding, format=fmt, gzip=gz, damage=damage,
                cut=cut)


REG, DIR = tarfile.REGTYPE, tarfile.DIRTYPE
# (spec, max_members, max_member_bytes, max_extract_bytes): falsifying examples seen while
# writing the property, and one case per refusal the loader must make.
TAR_CASES = {
    "valid": (tar_spec(("T/a.nii.gz", REG, 10, ""), ("T/d", DIR, 0, ""),
                       ("T/._a.nii.gz", REG, 5, ""), ("__MACOSX/x", REG, 5, "")), 10, MiB, MiB),
    "newline-in-unsafe-name": (tar_spec(("a\nb", tarfile.SYMTYPE, 0, "x")), 10, MiB, MiB),
    "escape-in-absolute-name": (tar_spec(("/esc\x1b[0m", REG, 1, "")), 10, MiB, MiB),
    "line-separator-in-name": (tar_spec(("../x\u2028y", REG, 1, "")), 10, MiB, MiB),
    "dotdot-into-sibling": (tar_spec(("../outside/y", REG, 1, "")), 10, MiB, MiB),
    "absolute-into-sibling": (tar_spec(("{OUT}/y", REG, 1, "")), 10, MiB, MiB),
    "hard-link": (tar_spec(("a", REG, 1, ""), ("b", tarfile.LNKTYPE, 0, "a")), 10, MiB, MiB),
    "fifo": (tar_spec(("f", tarfile.FIFOTYPE, 0, "")), 10, MiB, MiB),
    "pax-sparse-bomb": (tar_spec(("big", "pax-sparse", 5000, "")), 10, KiB, MiB),
    "too-many-members": (tar_spec(padding=40), 10, MiB, MiB),
    "member-over-limit": (tar_spec(("a", REG, 3000, "")), 10, KiB, MiB),
    "total-over-limit": (tar_spec(("a", REG, 1500, ""), ("b", REG, 1500, "")), 10, 4 * KiB,
                         2 * KiB),
    "truncated-in-data": (tar_spec(("a", REG, 3000, ""), damage="cut", cut=0.2), 10, MiB, MiB),
    "truncated-gzip-stream": (tar_spec(("a", REG, 3000, ""), gz=True, damage="cut-gzip"),
                              10, MiB, MiB),
}


@pytest.mark.parametrize("name", sorted(TAR_CASES))
def test_extract_tar_known_cases(name):
    """The property on fixed archives: earlier falsifying examples and one case per limit."""
    result = tar_outcome(*TAR_CASES[name])
    if name == "valid":
        assert result == "extracted", result
    else:
        assert result.startswith("StepError"), f"{name}: extracted, expected a refusal"
