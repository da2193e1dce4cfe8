"""The CUDA kernels executed on the CPU: the same source compiled as C++ through cuda_shim.h.

The real launcher (``_kernels.run`` / ``_launch``) runs unchanged; only CuPy is replaced, by a
stand-in for the part of its API the launcher uses (``RawModule``, ``asarray``, ``Device``,
``ExternalStream``). Its kernel call checks the arguments against the kernel's C signature
(pointer element sizes, ``np.int32`` scalars: what CuPy would pass to the GPU byte for byte),
then runs the compiled source for every (block, thread) of the grid with checked pointers.

Each launch must read and write only inside its buffers (the table, the constants, the output,
and each source image's exact extent), with the buffers' element sizes, and write every output
element exactly once. Results are compared with the torch reference over a seeded fuzz of op
lists, batch kinds (uniform, channels_last, cropped views, variable sizes, HWC views), channel
counts and output formats. Tolerances:

- float32: within ``bound = eps32 * range * (side + 8)``, where ``range`` is the largest value
  the value ops give a 0-255 pixel (max over channels of 255 |a| + |b|) and ``side`` the largest
  image side: both compute bilinear weights from float32 source positions (rounded to
  ulp(side) / 2, and torch's CPU paths do not all round alike), in a different order, and the
  kernel applies Normalize as a * p + b where torch does (p - mean) / std;
- float16 / bfloat16: within one unit in the last place of the reference's value in that dtype,
  plus ``bound`` (which matters only near zero, where a float16 ulp is below float32 noise);
- uint8: within 1, and off by 1 only where the reference's float32 value lies within ``bound``
  of a rounding boundary (k + 0.5).

The fuzz runs ``GPULOAD_KERNEL_FUZZ`` cases (default 300). Every source variant is compiled
once per session (in parallel) into a temporary directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import random
import shutil
import subprocess
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuload import transforms as T
from gpuload.transforms import _kernels, reference

SHIM = Path(__file__).with_name("cuda_shim.h")
KERNEL = "gpuload_transform"
DEVICE = torch.device("cpu", 0)  # stands for the CUDA device the launcher targets
FUZZ_CASES = int(os.environ.get("GPULOAD_KERNEL_FUZZ", "300"))
OUT_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)
VARIANTS = [(i, o, cl) for i in (torch.uint8, torch.float32) for o in OUT_DTYPES for cl in (False, True)]


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


CXX = _compiler()
pytestmark = pytest.mark.skipif(
    CXX is None, reason="no C++ compiler (CXX, g++, c++ or clang++) on PATH to build the kernels for the CPU"
)

# The driver: the shim, the kernel source as the launcher hands it to CuPy, and the exports.
_DRIVER = """#include "cuda_shim.h"
{source}
GPULOAD_SHIM_EXPORT({kernel})
extern "C" void shim_cast_out(const float* values, OUT_T* out, long long n) {{
    for (long long i = 0; i < n; ++i) out[i] = cast_out(values[i]);
}}
"""


class Builds:
    """Kernel sources compiled to shared libraries, once per session, keyed by the source text."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self._libraries: dict[str, ctypes.CDLL] = {}

    def library(self, source: str) -> ctypes.CDLL:
        key = hashlib.sha256((source + SHIM.read_text()).encode()).hexdigest()[:16]
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:
            if key not in self._libraries:
                self._libraries[key] = self._load(self._compile(source, key))
        return self._libraries[key]

    def _compile(self, source: str, key: str) -> Path:
        cpp = self.directory / f"kernel_{key}.cpp"
        so = self.directory / f"kernel_{key}.so"
        cpp.write_text(_DRIVER.format(source=source, kernel=KERNEL))
        command = [CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off",
                   "-Wall", "-Wno-unused-function", "-I", str(SHIM.parent), "-o", str(so), str(cpp)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise AssertionError(f"the kernel source does not compile as C++:\n{result.stderr[-4000:]}")
        if "warning" in result.stderr:
            raise AssertionError(f"the kernel source compiles with warnings:\n{result.stderr[-4000:]}")
        return so

    @staticmethod
    def _load(path: Path) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        lib.shim_add_region.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p]
        lib.shim_add_region.restype = ctypes.c_int
        lib.shim_errors.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.shim_errors.restype = ctypes.c_longlong
        lib.shim_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.shim_launch.restype = ctypes.c_longlong
        lib.shim_signature.restype = ctypes.c_char_p
        lib.shim_float_to_half.argtypes = [ctypes.c_float]
        lib.shim_float_to_half.restype = ctypes.c_ushort
        lib.shim_cast_out.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
        return lib


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> Builds:
    return Builds(tmp_path_factory.mktemp("kernels_cpu"))


# ------------------------------------------------------------------ the CuPy stand-in


_NUMPY_DTYPES = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int64: np.int64, torch.float32: np.float32}


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Bytes [begin, end) a tensor view spans."""
    begin = t.data_ptr()
    if t.numel() == 0:
        return begin, begin
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return begin, begin + (last + 1) * t.element_size()


class _DeviceArray:
    """``cupy.asarray(tensor)``: the tensor's own memory (no copy), as CuPy's zero-copy import."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"CuPy has no dtype for {tensor.dtype}")
        self.tensor = tensor
        self.dtype = np.dtype(_NUMPY_DTYPES[tensor.dtype])


class _Kernel:
    """A compiled kernel: ``fn(grid, block, args)`` runs it for every block and thread, checked."""

    def __init__(self, cupy: CpuCuPy, lib: ctypes.CDLL, variant: tuple) -> None:
        self.cupy, self.lib, self.variant = cupy, lib, variant
        self.signature = lib.shim_signature().decode().split(",")

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        grid3, block3 = _dims(grid), _dims(block)
        assert 1 <= math.prod(block3) <= 1024 and all(g >= 1 for g in grid3), (grid, block)
        assert shared_mem == 0
        assert len(args) == len(self.signature), f"{len(args)} arguments for {self.signature}"
        lib = self.lib
        lib.shim_reset()
        values, outputs = [], []
        for position, (arg, code) in enumerate(zip(args, self.signature)):
            kind, size = code[0], int(code[1:])
            if kind in "rw":
                assert isinstance(arg, _DeviceArray), f"argument {position}: {type(arg)} for a pointer"
                assert arg.dtype.itemsize == size, f"argument {position}: {arg.dtype} for {size}-byte elements"
                begin, end = _extent(arg.tensor)
                writes = None
                if kind == "w":
                    assert arg.tensor.is_contiguous(), f"argument {position}: output must be dense"
                    writes = np.zeros(arg.tensor.numel(), dtype=np.uint32)
                    outputs.append((position, writes))
                lib.shim_add_region(begin, end, size, None if writes is None else writes.ctypes.data)
                values.append(ctypes.c_uint64(begin))
            else:
                expected = {"i4": np.int32, "i8": np.int64, "f4": np.float32}[code]
                assert type(arg) is expected, f"argument {position}: {type(arg).__name__} for a {code} parameter"
                values.append({"i4": ctypes.c_int32, "i8": ctypes.c_int64, "f4": ctypes.c_float}[code](arg.item()))
        for tensor in self.cupy.pending_sources:
            begin, end = _extent(tensor)
            lib.shim_add_region(begin, end, tensor.element_size(), None)
        self.cupy.pending_sources.clear()
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        dims = (ctypes.c_uint * 3)
        errors = lib.shim_launch(dims(*grid3), dims(*block3), pointers)
        if errors:
            message = ctypes.create_string_buffer(1024)
            lib.shim_errors(message, 1024)
            raise AssertionError(f"{errors} bad memory accesses; first: {message.value.decode()}")
        for position, writes in outputs:
            wrong = np.flatnonzero(writes != 1)
            assert not len(wrong), (
                f"argument {position}: {len(wrong)} of {len(writes)} elements not written exactly once "
                f"(element {wrong[0]} written {writes[wrong[0]]} times)"
            )
        self.cupy.launches.append(self.variant)


def _dims(value) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in value) + (1, 1)
    return dims[:3]


class CpuCuPy(types.ModuleType):
    """The part of CuPy that ``_kernels`` uses, running the kernels on the CPU."""

    def __init__(self, builds: Builds) -> None:
        super().__init__("cupy")
        self.builds = builds
        self.launches: list[tuple] = []
        self.pending_sources: list[torch.Tensor] = []  # images the next launch may read
        self.cuda = types.SimpleNamespace(
            Device=contextlib.nullcontext, ExternalStream=contextlib.nullcontext,
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        )
        self.RawModule = self._raw_module
        self.asarray = _DeviceArray

    def _raw_module(self, code: str, options=()):
        assert "--std=c++14" in options
        lib = self.builds.library(code)
        variant = next(v for v in VARIANTS if _kernels.kernel_source(*v) == code)
        kernel = _Kernel(self, lib, variant)

        def get_function(name: str) -> _Kernel:
            assert name == KERNEL
            return kernel

        return types.SimpleNamespace(get_function=get_function)


@pytest.fixture
def cpu_cupy(builds, monkeypatch) -> CpuCuPy:
    """``_kernels.run`` on DEVICE runs the compiled CUDA source through the real launcher."""
    fake = CpuCuPy(builds)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_kernels, "_functions", {})  # no stand-in kernels outlive the test
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    real_sources = _kernels._sources

    def sources(batch):  # the images a launch may read: each one's exact extent
        fake.pending_sources[:] = list(batch.unbind(0)) if isinstance(batch, torch.Tensor) else list(batch)
        return real_sources(batch)

    monkeypatch.setattr(_kernels, "_sources", sources)
    return fake


# ------------------------------------------------------------------ conversions and variants


def test_every_variant_compiles_as_cpp_with_the_launchers_signature(builds):
    sources = [_kernels.kernel_source(*variant) for variant in VARIANTS]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        libraries = list(pool.map(builds.library, sources))
    for (_, out_dtype, _), lib in zip(VARIANTS, libraries):
        size = torch.empty((), dtype=out_dtype).element_size()
        assert lib.shim_signature().decode() == f"r8,i4,r4,w{size},i4,i4,i4,i4,i4"


def _half_boundaries() -> torch.Tensor:
    """Every float16 value, the midpoints between neighbours and the floats next to them."""
    halves = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    mids = (halves[:-1].double() + halves[1:].double()) / 2
    mids = mids.float()
    near = [mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))]
    special = torch.tensor([0.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e30, float("inf"), 2**-25, 2**-26])
    values = torch.cat([halves, *near, special])
    return torch.cat([values, -values])


def test_shim_float_to_half_rounds_like_the_gpu(builds):
    lib = builds.library(_kernels.kernel_source(torch.uint8, torch.float16, False))
    values = _half_boundaries()
    ours = torch.tensor([lib.shim_float_to_half(v) for v in values.tolist()], dtype=torch.int32)
    expected = values.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(ours, expected)
    assert lib.shim_float_to_half(float("nan")) & 0x7FFF > 0x7C00


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_kernel_output_cast_matches_torch(builds, out_dtype):
    """cast_out (rint + clamp, the shim's half, the kernel's own bfloat16) against torch's casts."""
    lib = builds.library(_kernels.kernel_source(torch.uint8, out_dtype, False))
    g = torch.Generator().manual_seed(0)
    values = torch.cat([
        _half_boundaries(),
        torch.randn(20000, generator=g) * 300,
        torch.arange(-2, 258, 0.5),  # uint8 ties: round half to even
        torch.rand(20000, generator=g).mul(80).sub(40).exp2() * torch.randn(20000, generator=g).sign(),
    ]).contiguous()
    physical = torch.int16 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    out = torch.empty(len(values), dtype=physical)
    lib.shim_cast_out(values.data_ptr(), out.data_ptr(), len(values))
    if out_dtype == torch.uint8:
        expected = values.round().clamp(0, 255).to(torch.uint8)
    else:
        expected = values.to(out_dtype)
    assert torch.equal(out.view(out_dtype), expected)
    if out_dtype == torch.bfloat16:
        nan = torch.tensor([float("nan")])
        lib.shim_cast_out(nan.data_ptr(), out.data_ptr(), 1)
        assert out[:1].view(torch.bfloat16).isnan().all()


# ------------------------------------------------------------------ the fuzz


def _random_ops(rng: random.Random, channels: int) -> list[T.Op]:
    ops: list[T.Op] = []
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4])):
        kind = rng.choice(["rrc", "resize", "center", "crop", "flip"])
        size = (rng.randint(1, 24), rng.randint(1, 24))
        if kind == "rrc":
            lo = rng.uniform(0.02, 1.0)
            ops.append(T.RandomResizedCrop(size, scale=(lo, rng.uniform(lo, 1.0)),
                                           ratio=rng.choice([(3 / 4, 4 / 3), (0.2, 5.0), (1.0, 1.0)])))
        elif kind == "resize":
            ops.append(T.Resize(rng.randint(1, 30) if rng.random() < 0.4 else size))
        elif kind == "center":
            ops.append(T.CenterCrop(size))
        elif kind == "crop":
            padding = rng.choice([0, rng.randint(1, 4), (rng.randint(0, 3), rng.randint(0, 3))])
            ops.append(T.RandomCrop(size, padding=padding, fill=rng.choice([0, rng.randint(0, 255)])))
        else:
            ops.append(T.RandomHorizontalFlip(p=rng.choice([0.0, 0.5, 1.0])))
    if rng.random() < 0.3:
        ops.append(T.ColorJitter(brightness=rng.uniform(0, 0.9), contrast=rng.choice([0, rng.uniform(0, 0.9)]),
                                 saturation=rng.uniform(0, 0.9)))
    erasings = rng.choice([0, 0, 1, 2])
    if rng.random() < 0.75:
        scale = rng.random() < 0.7
        ops.append(T.ToDtype(rng.choice([torch.float32, torch.float16, torch.bfloat16]), scale=scale))
        if rng.random() < 0.6:
            k = rng.choice([1, channels])
            top = 1.0 if scale else 255.0
            ops.append(T.Normalize([rng.uniform(0, top) for _ in range(k)],
                                   [rng.uniform(0.05, 1.0) * top for _ in range(k)]))
        value_top = 1.0
    else:
        value_top = 255.0
    for _ in range(erasings):
        value = [rng.uniform(0, value_top) for _ in range(rng.choice([1, channels]))]
        ops.append(T.RandomErasing(p=rng.uniform(0.3, 1.0), value=value))
    if rng.random() < 0.4:
        ops.append(T.ToChannelsLast())
    return ops


def _random_batch(rng: random.Random, g: torch.Generator, channels: int):
    kind = rng.choice(["uniform", "channels_last", "view", "list", "list_hwc"])
    n = rng.choice([1, 2, 3, 5, 8])
    side = 160 if rng.random() < 0.1 else 40  # now and then larger images: larger coordinates
    h, w = rng.randint(1, side), rng.randint(1, side)

    def pixels(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    if kind == "uniform":
        return kind, pixels(n, channels, h, w)
    if kind == "channels_last":
        return kind, pixels(n, h, w, channels).permute(0, 3, 1, 2)
    if kind == "view":  # a crop of a bigger batch: strides that are not the shape's
        dy, dx = rng.randint(0, 5), rng.randint(0, 5)
        return kind, pixels(n + 1, channels + 1, h + dy + 2, w + dx + 3)[1:, 1:, dy : dy + h, dx : dx + w]
    images = []
    for _ in range(n):
        h, w = rng.randint(1, side), rng.randint(1, side)
        hwc = kind == "list_hwc" and rng.random() < 0.6
        images.append(pixels(h, w, channels).permute(2, 0, 1) if hwc else pixels(channels, h, w))
    return kind, images


def _random_case(case: int):
    rng = random.Random(case)
    g = torch.Generator().manual_seed(case)
    for _ in range(100):
        channels = rng.choice([1, 3, 3])
        ops = _random_ops(rng, channels)
        kind, batch = _random_batch(rng, g, channels)
        if isinstance(batch, list) and not any(isinstance(op, (T.CenterCrop, T.RandomCrop, T.RandomResizedCrop))
                                               for op in ops):
            ops.insert(sum(isinstance(op, T.ops.GEOMETRIC_OPS) for op in ops), T.CenterCrop(rng.randint(1, 20)))
        n = len(batch)
        try:
            params = T.sample_params(ops, case, rng.randint(0, 3), torch.arange(n) * 7 + case,
                                     reference.batch_sizes(batch))
            params.output_size()
        except ValueError:  # a crop bigger than an image, or outputs of different sizes: draw again
            continue
        return ops, kind, batch, params
    raise AssertionError(f"case {case}: no valid op list in 100 draws")


def _reference_values(params, batch) -> torch.Tensor:
    """The reference's float32 values before its final cast (to judge uint8 rounding)."""
    ops = params.ops
    n_geo = sum(isinstance(op, T.ops.GEOMETRIC_OPS) for op in ops)
    images = list(batch.unbind(0)) if isinstance(batch, torch.Tensor) else list(batch)
    canvas = torch.stack([reference._geometry(ops[:n_geo], params, k, image) for k, image in enumerate(images)])
    return reference.apply_value_ops(ops[n_geo:], params.per_op[n_geo:], canvas, cast_output=False)


def _value_range(params, channels: int) -> float:
    """The largest magnitude the value ops give a 0-255 pixel: max over channels of 255|a| + |b|."""
    n_geo = sum(isinstance(op, T.ops.GEOMETRIC_OPS) for op in params.ops)
    a, b, _ = _kernels.value_constants(params.ops[n_geo:], channels)
    return float((255 * a.abs() + b.abs()).max())


def _largest_side(batch) -> int:
    images = batch.unbind(0) if isinstance(batch, torch.Tensor) else batch
    return max((max(image.shape[1:]) for image in images), default=1)


def _largest(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def assert_matches_reference(out: torch.Tensor, params, batch) -> None:
    ref = T.apply_reference(params, batch)
    assert (out.dtype, out.shape) == (ref.dtype, ref.shape)
    cl = torch.channels_last
    assert out.is_contiguous(memory_format=cl) == ref.is_contiguous(memory_format=cl)
    assert out.is_contiguous() == ref.is_contiguous()
    # Both sides compute bilinear weights from float32 source positions (up to the image side),
    # rounded to ulp(side) / 2, and torch's CPU paths do not all round alike: a value may move by
    # eps * side of the value range. Plus a few ulps of the range for the arithmetic's order.
    eps = torch.finfo(torch.float32).eps
    bound = eps * _value_range(params, out.shape[1]) * (_largest_side(batch) + 8)
    if out.dtype == torch.uint8:
        diff = (out.int() - ref.int()).abs()
        values = _reference_values(params, batch)
        on_boundary = ((values - 0.5) - (values - 0.5).round()).abs() <= bound
        assert _largest(diff) <= 1 and bool((on_boundary | (diff == 0)).all())
        return
    if out.dtype == torch.float32:
        assert _largest((out - ref).abs()) <= bound
        return
    magnitude = ref.abs()
    ulp = (torch.nextafter(magnitude, torch.tensor(float("inf"), dtype=ref.dtype)) - magnitude).float()
    excess = (out.float() - ref.float()).abs() - ulp
    assert _largest(excess) <= bound, f"off by more than one {out.dtype} ulp (+ {bound:.2g})"


def test_kernels_match_the_reference_over_a_fuzz(cpu_cupy):
    unfused, kinds = 0, set()
    for case in range(FUZZ_CASES):
        ops, kind, batch, params = _random_case(case)
        out = _kernels.run(params, batch, DEVICE)
        if out is None:  # the fused map cannot express this geometry; the reference runs
            unfused += 1
            continue
        kinds.add(kind)
        try:
            assert_matches_reference(out, params, batch)
        except AssertionError as exc:
            raise AssertionError(f"case {case} ({kind} batch, ops {list(ops)}): {exc}") from exc
    used = set(cpu_cupy.launches)
    assert unfused < FUZZ_CASES // 3  # about a quarter: two resizes, padding before a resize
    if FUZZ_CASES >= 300:  # the default fuzz reaches every kernel variant and batch kind
        assert used == set(VARIANTS), sorted(map(str, set(VARIANTS) - used))
        assert kinds == {"uniform", "channels_last", "view", "list", "list_hwc"}


def test_empty_batches_launch_nothing(cpu_cupy):
    ops = [T.RandomResizedCrop(8), T.ToDtype()]
    params = T.sample_params(ops, 0, 0, torch.arange(0), torch.zeros((0, 2), dtype=torch.int64))
    out = _kernels.run(params, torch.zeros((0, 3, 9, 9), dtype=torch.uint8), DEVICE)
    assert out is not None and out.numel() == 0 and not cpu_cupy.launches


# ------------------------------------------------------------------ the checks can fail


def _one_case(n=3):
    ops = [T.RandomResizedCrop((6, 7)), T.RandomHorizontalFlip(), T.ToDtype(torch.float16), T.ToChannelsLast()]
    batch = torch.randint(0, 256, (n, 3, 12, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return T.sample_params(ops, 0, 0, torch.arange(n), reference.batch_sizes(batch)), batch


def test_a_read_outside_the_image_is_caught(cpu_cupy, monkeypatch):
    real_plan = _kernels.geometry_plan

    def window_past_the_edge(params, sizes):
        table, fill = real_plan(params, sizes)
        table = table.clone()
        table[1, 0] += 12  # image 1's window moves a whole image height down: into image 2
        return table, fill

    monkeypatch.setattr(_kernels, "geometry_plan", window_past_the_edge)
    params, batch = _one_case()
    with pytest.raises(AssertionError, match="out of bounds"):
        _kernels.run(params, batch, DEVICE)


def test_a_pointer_into_no_buffer_is_caught(cpu_cupy, monkeypatch):
    real_sources = _kernels._sources

    def wrong_address(batch):
        rows, dtype = real_sources(batch)
        rows = rows.clone()
        rows[2, 0] += 1 << 40
        return rows, dtype

    monkeypatch.setattr(_kernels, "_sources", wrong_address)
    params, batch = _one_case()
    with pytest.raises(AssertionError, match="no buffer"):
        _kernels.run(params, batch, DEVICE)


def test_an_unwritten_output_element_is_caught(cpu_cupy, monkeypatch):
    real_call = _Kernel.__call__

    def one_block_short(self, grid, block, args, **kwargs):
        return real_call(self, (grid[0] - 1,), block, args, **kwargs)

    monkeypatch.setattr(_Kernel, "__call__", one_block_short)
    params, batch = _one_case(n=8)  # 8 * 6 * 7 = 336 threads: two blocks of 256
    with pytest.raises(AssertionError, match="not written exactly once"):
        _kernels.run(params, batch, DEVICE)


def test_a_wrongly_typed_argument_is_caught(cpu_cupy, monkeypatch):
    real_call = _Kernel.__call__

    def row_as_int64(self, grid, block, args, **kwargs):  # CuPy would pass 8 bytes for an int
        return real_call(self, grid, block, (args[0], np.int64(args[1]), *args[2:]), **kwargs)

    monkeypatch.setattr(_Kernel, "__call__", row_as_int64)
    params, batch = _one_case()
    with pytest.raises(AssertionError, match="int64 for a i4 parameter"):
        _kernels.run(params, batch, DEVICE)


def test_transform_batch_runs_the_kernels_or_says_why_cupy_cannot(cpu_cupy, monkeypatch):
    """``transform_batch`` on a device whose kernels work: the kernels' batch, named "cupy"; a
    geometry the fused map cannot express (two resizes) is refused under backend="cupy" and
    computed by the torch ops under "auto"."""
    monkeypatch.setattr(_kernels, "available", lambda device: (True, ""))
    params, batch = _one_case()
    out, backend = T.transform_batch(params.ops, batch, 0, 0, torch.arange(3), DEVICE, backend="cupy")
    assert backend == "cupy" and cpu_cupy.launches
    assert_matches_reference(out, params, batch)
    two_resizes = [T.Resize((9, 8)), T.Resize((6, 5)), T.ToDtype()]
    with pytest.raises(RuntimeError, match="needs the reference"):
        T.transform_batch(two_resizes, batch, 0, 0, torch.arange(3), DEVICE, backend="cupy")
    out, backend = T.transform_batch(two_resizes, batch, 0, 0, torch.arange(3), DEVICE, backend="auto")
    assert backend == "torch" and out.shape == (3, 3, 6, 5)


def test_a_kernel_input_dtype_other_than_uint8_or_float32_is_refused():
    with pytest.raises(ValueError, match="uint8 or float32, not torch.float16"):
        _kernels.kernel_source(torch.float16, torch.float32, False)
