"""Fused CUDA kernels for the transforms; the only module that imports CuPy (lazily).

One kernel does crop + bilinear resize + pad + flip + ToDtype + Normalize + RandomErasing +
cast + layout in a single pass: each thread computes one output pixel for all channels and
reads the uint8 source directly (no intermediate batch). Source images are addressed by a
per-sample pointer and strides, so a uniform NCHW batch, a list of CHW images of different
sizes, or HWC images all work without a copy.

The kernel reads the per-sample map of ``geometry.geometry_plan`` (a source window resized to
a canvas, a crop of it with a box of valid pixels, a final mirror). Batches the map cannot
express (two resizes, padding before a resize, different fills) return None and the caller
uses the torch reference.

With ColorJitter the kernel runs twice: uint8 -> float32 canvas (geometry only), then the
jitter in torch (it needs per-image means), then float32 -> output (values and layout).

A kernel that cannot be built or launched on the device (CuPy or NVRTC missing, a compile
error, a binary the device cannot load) raises :class:`KernelUnavailable`; out of memory and
CUDA errors propagate as they are. The tests also compile the same CUDA C as C++ and run it on
the CPU (``tests/transforms/cuda_shim.h``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

from gpuload.transfer import Staging, to_device
from gpuload.transforms import reference
from gpuload.transforms.geometry import PLAN_COLUMNS, geometry_plan
from gpuload.transforms.ops import GEOMETRIC_OPS, ColorJitter, Normalize, Op, RandomErasing, ToDtype
from gpuload.transforms.params import BatchParams

__all__ = [
    "GEOMETRY_COLUMNS",
    "KernelUnavailable",
    "available",
    "erasing_columns",
    "value_constants",
    "kernel_source",
    "run",
]

# Per-sample int64 row: source address and strides (elements), then the geometry.
GEOMETRY_COLUMNS = ("ptr", "stride_c", "stride_y", "stride_x", *PLAN_COLUMNS)
_ERASE_COLUMNS = 5  # apply, top, left, height, width (per RandomErasing op)

_OUT_KINDS = {torch.uint8: 0, torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_OUT_TYPES = {0: "unsigned char", 1: "unsigned short", 2: "unsigned short", 3: "float"}

_SOURCE = r"""
#define IN_T __IN_T__
#define OUT_T __OUT_T__
#define OUT_KIND __OUT_KIND__
#define CHANNELS_LAST __CHANNELS_LAST__

// Pointers are plain on the GPU. The CPU build of this source (tests/transforms/cuda_shim.h)
// defines PTR/PTR_AT first, as bounds-checked pointers that also count the writes.
#ifndef PTR
#define PTR(T) T*
#define PTR_AT(T, address) ((T*)(address))
#endif

__device__ __forceinline__ unsigned short to_half(float f) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return host_float_to_half(f);  // the CPU build: cuda_shim.h
#endif
}

__device__ __forceinline__ unsigned short to_bfloat16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ OUT_T cast_out(float v) {
#if OUT_KIND == 0
    return (unsigned char)fminf(fmaxf(rintf(v), 0.f), 255.f);
#elif OUT_KIND == 1
    return to_half(v);
#elif OUT_KIND == 2
    return to_bfloat16(v);
#else
    return v;
#endif
}

// torch's area_pixel_compute_source_index + guard_index_and_lambda (align_corners=False).
__device__ __forceinline__ void source_index(int dst, float scale, int size, int* i0, int* i1,
                                             float* lambda) {
    float real = scale * ((float)dst + 0.5f) - 0.5f;
    if (real < 0.f) real = 0.f;
    int i = min((int)floorf(real), size - 1);
    *lambda = fminf(fmaxf(real - (float)i, 0.f), 1.f);
    *i0 = i;
    *i1 = i + (i < size - 1 ? 1 : 0);
}

extern "C" __global__ void gpuload_transform(
    PTR(const long long) __restrict__ table, const int row, PTR(const float) __restrict__ consts,
    PTR(OUT_T) __restrict__ out, const int N, const int C, const int OH, const int OW, const int E)
{
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (tid >= (long long)N * OH * OW) return;
    const int x = (int)(tid % OW);
    const long long t = tid / OW;
    const int y = (int)(t % OH);
    const int n = (int)(t / OH);
    PTR(const long long) r = table + (long long)n * row;
    PTR(const IN_T) src = PTR_AT(const IN_T, r[0]);
    const long long sc = r[1], sy = r[2], sx = r[3];
    const int win_y0 = (int)r[4], win_x0 = (int)r[5], win_h = (int)r[6], win_w = (int)r[7];
    const int canvas_h = (int)r[8], canvas_w = (int)r[9], off_y = (int)r[10], off_x = (int)r[11];
    const int xs = r[16] ? OW - 1 - x : x;  // position before the final mirror
    const bool valid = y >= r[12] && y < r[13] && xs >= r[14] && xs < r[15];

    long long o00 = 0, o01 = 0, o10 = 0, o11 = 0;
    float ly = 0.f, lx = 0.f;
    if (valid) {
        int y0, y1, x0, x1;
        source_index(y + off_y, (float)win_h / (float)canvas_h, win_h, &y0, &y1, &ly);
        source_index(xs + off_x, (float)win_w / (float)canvas_w, win_w, &x0, &x1, &lx);
        const long long ry0 = (long long)(win_y0 + y0) * sy, ry1 = (long long)(win_y0 + y1) * sy;
        const long long rx0 = (long long)(win_x0 + x0) * sx, rx1 = (long long)(win_x0 + x1) * sx;
        o00 = ry0 + rx0; o01 = ry0 + rx1; o10 = ry1 + rx0; o11 = ry1 + rx1;
    }
    int erased = -1;  // the last RandomErasing whose rectangle holds (y, x) wins
    for (int e = 0; e < E; ++e) {
        PTR(const long long) q = r + __GEOMETRY_WIDTH__ + 5 * e;
        if (q[0] && y >= q[1] && y < q[1] + q[3] && x >= q[2] && x < q[2] + q[4]) erased = e;
    }
    const float fill = consts[2 * C];
    for (int c = 0; c < C; ++c) {
        float v;
        if (erased >= 0) {
            v = consts[2 * C + 1 + erased * C + c];
        } else {
            float p = fill;
            if (valid) {
                PTR(const IN_T) s = src + c * sc;
                const float wx0 = 1.f - lx, wy0 = 1.f - ly;
                p = ((float)s[o00] * wx0 + (float)s[o01] * lx) * wy0
                  + ((float)s[o10] * wx0 + (float)s[o11] * lx) * ly;
            }
            v = consts[c] * p + consts[C + c];
        }
#if CHANNELS_LAST
        out[(((long long)n * OH + y) * OW + x) * C + c] = cast_out(v);
#else
        out[(((long long)n * C + c) * OH + y) * OW + x] = cast_out(v);
#endif
    }
}
"""


def kernel_source(in_dtype: torch.dtype, out_dtype: torch.dtype, channels_last: bool) -> str:
    """CUDA source of the kernel variant reading ``in_dtype`` and writing ``out_dtype``."""
    if in_dtype not in (torch.uint8, torch.float32):
        raise ValueError(f"kernel input must be uint8 or float32, not {in_dtype}")
    kind = _OUT_KINDS[out_dtype]
    return (
        _SOURCE.replace("__IN_T__", "unsigned char" if in_dtype == torch.uint8 else "float")
        .replace("__OUT_T__", _OUT_TYPES[kind])
        .replace("__OUT_KIND__", str(kind))
        .replace("__CHANNELS_LAST__", "1" if channels_last else "0")
        .replace("__GEOMETRY_WIDTH__", str(len(GEOMETRY_COLUMNS)))
    )


# ------------------------------------------------------------------- constants (pure torch)


def value_constants(ops: Sequence[Op], channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel (a, b) with output = a * pixel + b, and each RandomErasing's output value.

    ``pixel`` is 0-255; erasing values are mapped through the ops after them.
    """
    a = torch.ones(channels, dtype=torch.float64)
    b = torch.zeros(channels, dtype=torch.float64)
    erasings: list[torch.Tensor] = []  # output values, updated as later ops come
    scaled = False
    for op in ops:
        if isinstance(op, ToDtype) and op.scale:
            a, b = a / 255.0, b / 255.0
            erasings = [v / 255.0 for v in erasings]
            scaled = True
        elif isinstance(op, Normalize):
            mean, std = (t.double() for t in reference.normalize_constants(op, scaled, channels))
            a, b = a / std, (b - mean) / std
            erasings = [(v - mean) / std for v in erasings]
        elif isinstance(op, RandomErasing):
            erasings.append(reference.erase_values(op, channels).double())
    values = torch.stack(erasings) if erasings else torch.zeros((0, channels), dtype=torch.float64)
    return a.float(), b.float(), values.float()


def erasing_columns(params: BatchParams) -> torch.Tensor:
    """(N, 5 * E) int64: apply, top, left, height, width of each RandomErasing op."""
    cols = []
    for op, p in zip(params.ops, params.per_op):
        if isinstance(op, RandomErasing):
            cols += [p["apply"].to(torch.int64), p["top"], p["left"], p["height"], p["width"]]
    n = len(params.indices)
    return torch.stack(cols, 1) if cols else torch.zeros((n, 0), dtype=torch.int64)


# ------------------------------------------------------------------------- CuPy execution

_lock = threading.Lock()
_functions: dict[tuple[int, torch.dtype, torch.dtype, bool], object] = {}
_status: dict[int, str] = {}  # device index -> "" when usable, else why not

# CUresult codes that mean "this kernel cannot be built or launched on this device", as opposed
# to a failure of the work (out of memory, illegal address, launch failure), which must surface.
_UNLOADABLE = {
    200: "CUDA_ERROR_INVALID_IMAGE",
    209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
    218: "CUDA_ERROR_INVALID_PTX",
    221: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
    222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    223: "CUDA_ERROR_JIT_COMPILATION_DISABLED",
    300: "CUDA_ERROR_INVALID_SOURCE",
    701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
}
_NVRTC_ERROR_OUT_OF_MEMORY = 1


class KernelUnavailable(RuntimeError):
    """The kernels cannot be compiled or launched on this device (CuPy or NVRTC missing, a
    compile error, a binary the device cannot load): not a failure of the batch."""


def available(device: torch.device) -> tuple[bool, str]:
    """Whether CuPy can compile and run kernels on ``device``, and if not, what is missing
    (checked once per device: CuPy imports, NVRTC loads, the device exists)."""
    if device.type != "cuda":
        return False, f"{device} is not a CUDA device"
    index = torch.cuda.current_device() if device.index is None else device.index
    with _lock:
        if index not in _status:
            _status[index] = _runtime_problem(index)
        reason = _status[index]
    return reason == "", reason


def _runtime_problem(index: int) -> str:
    """"" when CuPy, NVRTC and CUDA device ``index`` are usable, else what is missing."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken install
        return (f"CuPy does not import ({type(exc).__name__}: {exc}); install the CuPy build for "
                "your CUDA, e.g. pip install cupy-cuda13x")
    try:
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:
        return (f"CuPy cannot load NVRTC, the CUDA runtime compiler ({type(exc).__name__}: {exc}); "
                "a CUDA build of torch brings it (or install the CUDA toolkit); gpuload doctor says more")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or a driver older than CuPy's CUDA
        return f"CuPy cannot use the CUDA driver ({type(exc).__name__}: {exc})"
    return "" if index < count else f"CuPy sees {count} device(s), not cuda:{index}"


def mark_unavailable(device: torch.device, reason: str) -> None:
    """Stop using the kernels on ``device`` (after a failure), remembering why."""
    index = torch.cuda.current_device() if device.index is None else device.index
    with _lock:
        _status[index] = reason


def _capability_problem(exc: BaseException) -> str | None:
    """What ``exc`` says the device or install cannot do, or None when it is a failure of the
    work itself (out of memory, a CUDA error, a bug), which the caller must see as it is."""
    if isinstance(exc, ImportError):
        return f"CuPy does not import ({exc})"
    try:
        from cupy.cuda import compiler, driver, nvrtc
    except Exception:  # pragma: no cover - CuPy imported before any kernel error can happen
        return None
    if isinstance(exc, compiler.CompileException):
        return f"NVRTC cannot compile the kernel ({exc})"
    if isinstance(exc, nvrtc.NVRTCError) and getattr(exc, "status", None) != _NVRTC_ERROR_OUT_OF_MEMORY:
        return f"NVRTC failed ({exc})"
    if isinstance(exc, driver.CUDADriverError) and getattr(exc, "status", None) in _UNLOADABLE:
        return f"the device cannot load or launch the kernel ({_UNLOADABLE[exc.status]}: {exc})"
    if type(exc).__name__ == "DynamicLibNotFoundError" or (
        isinstance(exc, RuntimeError) and str(exc).startswith("CuPy failed to load")
    ):
        return f"a CUDA library is missing ({exc})"
    return None


@contextlib.contextmanager
def _capability_errors(step: str) -> Iterator[None]:
    """Re-raise compile/launch-capability failures in the block as KernelUnavailable."""
    try:
        yield
    except Exception as exc:
        problem = _capability_problem(exc)
        if problem is None:
            raise
        raise KernelUnavailable(f"{step}: {problem}") from exc


def _function(index: int, in_dtype: torch.dtype, out_dtype: torch.dtype, channels_last: bool):
    key = (index, in_dtype, out_dtype, channels_last)
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            with _capability_errors("building the kernel"):
                import cupy

                with cupy.cuda.Device(index):
                    module = cupy.RawModule(
                        code=kernel_source(in_dtype, out_dtype, channels_last), options=("--std=c++14",)
                    )
                    fn = module.get_function("gpuload_transform")
            _functions[key] = fn
    return fn


def _sources(batch: reference.Batch) -> tuple[torch.Tensor, torch.dtype]:
    """(N, 4) int64 address and element strides of each image, and the element dtype."""
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0]
        base = batch.data_ptr() + torch.arange(n, dtype=torch.int64) * batch.stride(0) * batch.element_size()
        strides = torch.tensor(batch.stride()[1:], dtype=torch.int64).expand(n, 3)
        return torch.cat([base[:, None], strides], 1), batch.dtype
    rows = [[im.data_ptr(), *im.stride()] for im in batch]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4), batch[0].dtype


def _launch(
    device: torch.device,
    batch: reference.Batch,
    geometry: torch.Tensor,
    fill: float,
    constants: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    erase_cols: torch.Tensor,
    out_dtype: torch.dtype,
    channels_last: bool,
    out_size: tuple[int, int],
    channels: int,
    staging: Staging | None,
) -> torch.Tensor:
    import numpy as np

    with _capability_errors("importing CuPy"):
        import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    sources, in_dtype = _sources(batch)
    table = torch.cat([sources, geometry, erase_cols], 1).contiguous()
    a, b, values = constants
    consts = torch.cat([a, b, torch.tensor([fill], dtype=torch.float32), values.reshape(-1)])
    n = len(table)
    oh, ow = out_size
    out = torch.empty((n, channels, oh, ow), dtype=out_dtype, device=device,
                      memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if n == 0 or oh * ow == 0:
        return out
    table_d, consts_d = to_device([table, consts], device, staging)
    physical = out.permute(0, 2, 3, 1) if channels_last else out  # contiguous either way
    if out_dtype == torch.bfloat16 or out_dtype == torch.float16:
        physical = physical.view(torch.int16)  # CuPy has no bfloat16; the kernel writes bits
    fn = _function(index, in_dtype, out_dtype, channels_last)
    threads = 256
    total = n * oh * ow
    with cupy.cuda.Device(index), _capability_errors("launching the kernel"):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            fn(
                ((total + threads - 1) // threads,),
                (threads,),
                (
                    cupy.asarray(table_d), np.int32(table.shape[1]), cupy.asarray(consts_d),
                    cupy.asarray(physical), np.int32(n), np.int32(channels), np.int32(oh),
                    np.int32(ow), np.int32(erase_cols.shape[1] // _ERASE_COLUMNS),
                ),
            )
    return out


def run(params: BatchParams, batch: reference.Batch, device: torch.device,
        staging: Staging | None = None) -> torch.Tensor | None:
    """The transformed batch computed by the kernels on ``device``, or None when the batch's
    geometry needs the reference (see ``geometry.geometry_plan``). ``batch`` must already be
    there; the kernels' tables reach it through ``staging`` (the loader's)."""
    ops = params.ops
    sizes = params.sizes[0]
    plan = geometry_plan(params, sizes)
    if plan is None:
        return None
    geometry, fill = plan
    out_h, out_w = params.output_size()
    channels = batch.shape[1] if isinstance(batch, torch.Tensor) else batch[0].shape[0]
    dtype, channels_last = reference.output_format(ops)
    n_geo = sum(isinstance(op, GEOMETRIC_OPS) for op in ops)
    value_ops = ops[n_geo:]
    jitter = [k for k, op in enumerate(value_ops) if isinstance(op, ColorJitter)]
    if not jitter:
        return _launch(device, batch, geometry, fill, value_constants(value_ops, channels),
                       erasing_columns(params), dtype, channels_last, (out_h, out_w), channels, staging)
    # Two passes around the jitter: geometry to a float32 canvas, jitter in torch, the rest.
    identity = value_constants((), channels)
    n = len(geometry)
    canvas = _launch(device, batch, geometry, fill, identity, torch.zeros((n, 0), dtype=torch.int64),
                     torch.float32, False, (out_h, out_w), channels, staging)
    last = jitter[-1] + 1
    canvas = reference.apply_value_ops(
        value_ops[:last], params.per_op[n_geo : n_geo + last], canvas, cast_output=False, staging=staging
    ).contiguous()
    full = torch.tensor([[0, 0, out_h, out_w, out_h, out_w, 0, 0, 0, out_h, 0, out_w, 0]],
                        dtype=torch.int64).expand(n, -1)
    return _launch(device, canvas, full, 0.0, value_constants(value_ops[last:], channels),
                   erasing_columns(params), dtype, channels_last, (out_h, out_w), channels, staging)
