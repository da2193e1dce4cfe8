"""The batched torch path: an op list run on a whole batch at once, in plain torch ops.

The CPU backend, and the fallback on a GPU when the CuPy kernels cannot run (any device).
Its results are the reference's: bit-exact (crops, padding, flips, the value ops and the
output cast are the same float32 operations in the same order; resizes call the same
bilinear kernel on the same float32 window, mirrored first when a flip comes before it).

The geometry is the kernels' per-sample map (``geometry.geometry_plan``): a source window,
resized to a canvas, then an offset, a box of valid pixels (outside is the fill) and a final
mirror. Without a resize the output is one gather from the uint8 batch, its flat indices built
for the whole batch by broadcasting per-sample row and column offsets. A resize loops over the
distinct source windows (one bilinear call for a batch that shares one, one per image for
random crops, which F.interpolate runs faster than any gather-based bilinear on a CPU; on a
CPU those calls are spread over the usable cores, ``cpu_threads.spread_over_cpus``) and
writes straight into the batch's canvas. The value ops then run once on that canvas, in place;
on a CPU, for a random crop's batch and value ops alike for every sample, they run on each
image's canvas as soon as it is resized instead, into the output (``_Finish``: a fifth less
CPU per image for the transforms of the bench's 224^2 crops than passes over a batch canvas).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpuload.cpu_threads import spread_over_cpus
from gpuload.transfer import Staging, to_device
from gpuload.transforms import reference
from gpuload.transforms.geometry import crop_windows, geometry_plan
from gpuload.transforms.ops import (
    GEOMETRIC_OPS,
    Normalize,
    Op,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToChannelsLast,
    ToDtype,
)
from gpuload.transforms.params import BatchParams

__all__ = ["run"]

_INT32_LIMIT = 2**31 - 1


def run(params: BatchParams, batch: reference.Batch, *, staging: Staging | None = None) -> torch.Tensor | None:
    """``reference.apply_reference(params, batch)`` for the whole batch at once, on the batch's
    device; None for the geometry the per-sample map cannot express (two resizes, padding
    before a resize, crops with different fills), which the reference then runs. The index
    tables and masks built on the host reach the device through ``staging`` (the loader's)."""
    images = batch if isinstance(batch, torch.Tensor) else list(batch)
    if len(images) != len(params.indices):
        raise ValueError(f"{len(images)} images but parameters for {len(params.indices)} samples")
    out_size = params.output_size()  # raises if the outputs cannot be stacked
    if len(images) == 0:
        return reference.apply_reference(params, batch, staging=staging)
    if not isinstance(images, torch.Tensor):
        channels = {image.shape[0] for image in images}
        if len(channels) > 1:
            raise ValueError(f"the images of one batch need one channel count, got {sorted(channels)}")
    plan = geometry_plan(params, params.sizes[0])
    if plan is None:
        return None
    table, fill = plan
    ops = params.ops
    n_geo = sum(isinstance(op, GEOMETRIC_OPS) for op in ops)
    value_ops, value_params = ops[n_geo:], params.per_op[n_geo:]
    if isinstance(images, torch.Tensor):
        windows = crop_windows(table, out_size, (images.shape[-2], images.shape[-1]))
    else:
        windows = None
    maps = None if windows is not None else _Maps(table, out_size, _mirrored_before_resize(params))
    if maps is None or not maps.resizes:
        if maps is None:
            assert isinstance(images, torch.Tensor) and windows is not None  # windows only of a stacked batch
            pixels = _window_gather(images, *windows, out_size, fill, staging)
        else:
            pixels = _gather(images, maps.rows(from_window=True), maps.cols(from_window=True), fill, staging)
        if pixels.dtype == torch.uint8 and all(isinstance(op, ToChannelsLast) for op in value_ops):
            # uint8 out and nothing but layout: the pixels are the reference's rounded floats.
            return pixels.contiguous(memory_format=torch.channels_last) if value_ops else pixels
        # The reference's float32 copy of the pixels, made once, which the value ops then
        # update in place (ToDtype's / 255 is the same float32 division either way).
        pixels = pixels.to(torch.float32)
    else:
        finish = _Finish.of(value_ops, len(images), _channels_of(images), out_size, _canvas_format(images),
                            _device_of(images))
        pixels = _resized(images, maps, fill, staging, finish)
        if finish is not None and pixels is finish.out:
            return pixels
    return reference.apply_value_ops(value_ops, value_params, pixels, owned=True, staging=staging)


def _channels_of(images: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """The channel count of a batch or of a list's images (one count: ``run`` checked it)."""
    return images.shape[1] if isinstance(images, torch.Tensor) else images[0].shape[0]


def _device_of(images: torch.Tensor | Sequence[torch.Tensor]) -> torch.device:
    """The device of a batch or of a list's first image."""
    return images.device if isinstance(images, torch.Tensor) else images[0].device


class _Finish:
    """The value ops run on each sample's resized canvas as soon as it is made, into the output
    batch (``out``): while the canvas is one image in a thread's cache, instead of on a float32
    canvas of the whole batch afterwards (a batch of 224^2 crops is 77 MB of float32, each op a
    pass over it, and the cast a transposing one). Only for value ops that treat every sample
    alike (``ToDtype``, ``Normalize``, ``ToChannelsLast``): the same float32 operations in the
    same order as ``reference.apply_value_ops``, element by element, so the results are its
    own. ``steps`` are in-place tensor methods with their operand, for a (1, C, H, W) canvas."""

    def __init__(self, steps: list[tuple[Callable[[torch.Tensor, Any], torch.Tensor], Any]], out: torch.Tensor,
                 rounds: bool) -> None:
        self.steps = steps
        self.out = out
        self.rounds = rounds  # a uint8 output: round and clamp before the cast, as the reference does

    @staticmethod
    def of(ops: Sequence[Op], n: int, channels: int, out_size: tuple[int, int], layout: torch.memory_format,
           device: torch.device) -> _Finish | None:
        """The per-sample finish of ``ops`` on a CPU ``device``; None for ops that need the batch
        (per-sample parameters: ``ColorJitter``, ``RandomErasing``), or off the CPU."""
        if device.type != "cpu" or not all(isinstance(op, (ToDtype, Normalize, ToChannelsLast)) for op in ops):
            return None
        canvas = torch.empty((1, channels, *out_size), dtype=torch.float32, memory_format=layout)
        steps: list[tuple[Callable[[torch.Tensor, Any], torch.Tensor], Any]] = []
        scaled = False
        for op in ops:
            if isinstance(op, ToDtype) and op.scale:
                steps.append((torch.Tensor.div_, 255.0))
                scaled = True
            elif isinstance(op, Normalize):
                mean, std = reference.normalize_constants(op, scaled, channels)
                steps += [(torch.Tensor.sub_, reference.per_channel(mean, canvas)),
                          (torch.Tensor.div_, reference.per_channel(std, canvas))]
        dtype, channels_last = reference.output_format(ops)
        out = torch.empty((n, channels, *out_size), dtype=dtype,
                          memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return _Finish(steps, out, dtype == torch.uint8)


class _Maps:
    """The plan's per-sample map, and the row/column maps of the output pixels it gives.

    Kept on the CPU: every decision about the batch is made there, without a device sync.
    """

    def __init__(self, table: torch.Tensor, out_size: tuple[int, int], pre_mirror: torch.Tensor) -> None:
        self.table = table
        self.out_size = out_size
        self.resizes = bool((table[:, 2:4] != table[:, 4:6]).any())
        self.flip = table[:, 12].bool()
        # The plan reads an unmirrored canvas; a sample flipped before its resize has its window
        # mirrored before resizing, as the reference does, so its canvas is read mirrored back.
        self.pre_mirror = pre_mirror

    def post_crop_is_identity(self) -> bool:
        """True when the canvases are the outputs up to the mirror (no crop after the resize)."""
        t, (oh, ow) = self.table, self.out_size
        expected = torch.tensor([oh, ow, 0, 0, 0, oh, 0, ow], dtype=t.dtype)
        return bool((t[:, 4:12] == expected).all())

    def rows(self, from_window: bool) -> torch.Tensor:
        """(N, OH) source row of each output row; -1 outside the box (the fill)."""
        t = self.table
        y = torch.arange(self.out_size[0]).view(1, -1)
        row = y + t[:, 6:7] + (t[:, 0:1] if from_window else 0)
        return torch.where((y >= t[:, 8:9]) & (y < t[:, 9:10]), row, -1)

    def cols(self, from_window: bool) -> torch.Tensor:
        """(N, OW) source column of each output column (after the mirror); -1 outside the box."""
        t = self.table
        ow = self.out_size[1]
        x = torch.arange(ow).view(1, -1)
        xs = torch.where(t[:, 12:13].bool(), ow - 1 - x, x)
        if from_window:
            col = xs + t[:, 7:8] + t[:, 1:2]
        else:
            col = xs + t[:, 7:8]
            col = torch.where(self.pre_mirror[:, None], t[:, 5:6] - 1 - col, col)
        return torch.where((xs >= t[:, 10:11]) & (xs < t[:, 11:12]), col, -1)


def _flat_source(images: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D view (or copy) holding every image, and (N, 4) int64 element offset and
    channel/row/column strides of each image in it."""
    if isinstance(images, torch.Tensor):
        n = images.shape[0]
        extent = 1 + sum((size - 1) * stride for size, stride in zip(images.shape, images.stride()))
        flat = images.as_strided((extent,), (1,))
        base = torch.arange(n, dtype=torch.int64) * images.stride(0)
        strides = torch.tensor(images.stride()[1:], dtype=torch.int64).expand(n, 3)
        return flat, torch.cat([base[:, None], strides], 1)
    flat = torch.cat([image.reshape(-1) for image in images])
    shapes = torch.tensor([tuple(image.shape) for image in images], dtype=torch.int64)
    numel = shapes.prod(1)
    base = torch.cumsum(numel, 0) - numel
    plane = shapes[:, 1] * shapes[:, 2]
    return flat, torch.stack([base, plane, shapes[:, 2], torch.ones_like(base)], 1)


def _fill_dtype(dtype: torch.dtype, fill: float) -> torch.dtype:
    """uint8 pixels stay uint8 under a whole-number fill (the reference's floats are then
    whole too); otherwise they become float32."""
    return dtype if dtype != torch.uint8 or fill == round(fill) else torch.float32


def _gather(
    images: torch.Tensor | Sequence[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor, fill: float,
    staging: Staging | None,
) -> torch.Tensor:
    """out[n, c, y, x] = images[n][c, rows[n, y], cols[n, x]], or ``fill`` where a row or
    column is -1: one index_select, its flat indices broadcast from per-sample offsets.

    A uniform batch that needs the fill is first copied into a border of it; a list gets the
    fill written afterwards.
    """
    fill_outside = bool((rows < 0).any()) or bool((cols < 0).any())
    outside = None
    if isinstance(images, torch.Tensor):
        if fill_outside:
            images, rows, cols = _with_fill_border(images, rows, cols, fill)
    elif fill_outside:
        outside = (rows < 0)[:, None, :, None] | (cols < 0)[:, None, None, :]
        rows, cols = rows.clamp(min=0), cols.clamp(min=0)
    flat, layout = _flat_source(images)
    channels = images.shape[1] if isinstance(images, torch.Tensor) else images[0].shape[0]
    n, oh, ow = rows.shape[0], rows.shape[1], cols.shape[1]
    index_dtype = torch.int32 if flat.numel() <= _INT32_LIMIT else torch.int64
    per_channel = layout[:, :1] + torch.arange(channels).view(1, -1) * layout[:, 1:2]
    per_row = (per_channel.view(n, channels, 1, 1) + (rows * layout[:, 2:3]).view(n, 1, oh, 1)).to(index_dtype)
    per_col = (cols * layout[:, 3:4]).view(n, 1, 1, ow).to(index_dtype)
    moved = to_device([per_row, per_col] + ([outside] if outside is not None else []), flat.device, staging)
    out = flat.index_select(0, torch.add(moved[0], moved[1]).view(-1)).view(n, channels, oh, ow)
    if outside is not None:
        out = out.to(_fill_dtype(out.dtype, fill)).masked_fill_(moved[2], fill)
    return out


def _window_gather(
    images: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    mirror: torch.Tensor,
    out_size: tuple[int, int],
    fill: float,
    staging: Staging | None,
) -> torch.Tensor:
    """out[n] = the (OH, OW) window at (top[n], left[n]) of images[n], mirrored first where
    ``mirror[n]``; ``fill`` outside the image (see ``geometry.crop_windows``).

    One ``index_select`` of whole windows: the source (or a framed copy: the images in a
    border of fill, mirrored images after the others) is viewed as one window per element
    offset, and each sample's window is picked by its offset. No per-pixel index is built.
    """
    n, channels, h, w = images.shape
    oh, ow = out_size
    pads = (
        max(0, -int(top.min())), max(0, int(top.max()) + oh - h),
        max(0, -int(left.min())), max(0, int(left.max()) + ow - w),
    )
    slot = torch.arange(n)
    source = images
    if any(pads) or bool(mirror.any()):
        source, slot = _framed(images, mirror, pads, fill, staging)
    strides = source.stride()
    stride_n, stride_c, stride_y, stride_x = strides
    extent = 1 + sum((size - 1) * stride for size, stride in zip(source.shape, strides))
    base = slot * stride_n + (top + pads[0]) * stride_y + (left + pads[2]) * stride_x
    span = (channels - 1) * stride_c + (oh - 1) * stride_y + (ow - 1) * stride_x
    starts = source.as_strided((extent - span, channels, oh, ow), (1, stride_c, stride_y, stride_x))
    (base,) = to_device([base], source.device, staging)
    return starts.index_select(0, base)


def _framed(
    images: torch.Tensor, mirror: torch.Tensor, pads: tuple[int, int, int, int], fill: float,
    staging: Staging | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous copy of ``images`` inside a border of ``fill`` (top, bottom, left, right
    ``pads``), the mirrored samples mirrored and after the others; and each sample's slot in it."""
    n, channels, h, w = images.shape
    top, bottom, left, right = pads
    framed = torch.empty(
        (n, channels, h + top + bottom, w + left + right),
        dtype=_fill_dtype(images.dtype, fill), device=images.device,
    )
    if any(pads):
        framed.fill_(fill)  # one pass: faster than filling the four borders (narrow strided strips)
    inner = framed[:, :, top : top + h, left : left + w]
    flipped = mirror.nonzero()[:, 0]
    if not len(flipped):
        inner.copy_(images)
        return framed, torch.arange(n)
    kept = (~mirror).nonzero()[:, 0]
    device = images.device
    kept_d, flipped_d = to_device([kept, flipped], device, staging)
    if len(kept):
        inner[: len(kept)].copy_(images.index_select(0, kept_d))
    mirrored = images.index_select(0, flipped_d)
    if framed.dtype == images.dtype:
        torch.ops.aten.flip.out(mirrored, [-1], out=inner[len(kept) :])  # no intermediate copy
    else:  # uint8 images in a float32 frame (a fractional fill)
        inner[len(kept) :].copy_(mirrored.flip(-1))
    slot = torch.empty(n, dtype=torch.int64)
    slot[kept] = torch.arange(len(kept))
    slot[flipped] = torch.arange(len(kept), n)
    return framed, slot


def _with_fill_border(
    images: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, fill: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``images`` inside a border of ``fill`` wide enough for every row and column read (-1
    reads the border), and the maps moved into it."""
    h, w = images.shape[-2:]
    top = max(0, -int(rows.min()))
    bottom = max(0, int(rows.max()) - (h - 1))
    left = max(0, -int(cols.min()))
    right = max(0, int(cols.max()) - (w - 1))
    shape = (*images.shape[:2], h + top + bottom, w + left + right)
    framed = torch.full(shape, fill, dtype=_fill_dtype(images.dtype, fill), device=images.device)
    framed[:, :, top : top + h, left : left + w] = images
    return framed, rows + top, cols + left


def _resized(
    images: torch.Tensor | Sequence[torch.Tensor], maps: _Maps, fill: float, staging: Staging | None,
    finish: _Finish | None = None,
) -> torch.Tensor:
    """The float32 (N, C, OH, OW) batch of a plan with a resize: each window resized to its
    canvas (one bilinear call per distinct window), then the crop after the resize and the
    mirror. With ``finish``, when every sample has a window of its own and its canvas is its
    output (a random crop's batch), ``finish.out``: each canvas finished as it is made."""
    table = maps.table
    post_identity = maps.post_crop_is_identity()
    uniform_canvas = bool((table[:, 4:6] == table[0, 4:6]).all())
    n = len(table)
    channels = _channels_of(images)
    device = _device_of(images)
    canvases: list[torch.Tensor | None] = [None] * n
    batch_canvas = None
    # A list's images share a bilinear call only through a stacked copy of their windows: when
    # each canvas is its sample's output, each sample gets a group of its own, so that two decoded
    # crops of one shape (their windows the same (0, 0, h, w): common in a batch of 128) do not
    # send the whole batch to the batch canvas.
    own_groups = finish is not None and post_identity and uniform_canvas and not isinstance(images, torch.Tensor)
    groups = _window_groups(images, table, shared=not own_groups)
    if finish is not None and not (post_identity and uniform_canvas and len(groups) == n):
        finish = None
    if finish is not None:
        ch, cw = (int(v) for v in table[0, 4:6])
        layout = _canvas_format(images)
        steps, output, rounds = finish.steps, finish.out, finish.rounds
    elif uniform_canvas:
        ch, cw = (int(v) for v in table[0, 4:6])
        batch_canvas = torch.empty(
            (n, channels, ch, cw), dtype=torch.float32, device=device, memory_format=_canvas_format(images)
        )
    mirror_here = post_identity and (batch_canvas is not None or finish is not None)
    # Per-sample flags as Python lists: a random crop's groups are one sample each, and
    # indexing a tensor per sample costs more than the sample's resize bookkeeping should.
    pre_mirror, flip = maps.pre_mirror.tolist(), maps.flip.tolist()

    def resize_one(source: torch.Tensor, k: int, canvas_size: tuple[int, int], out: torch.Tensor) -> None:
        # What the general case below does for a group of sample k alone, with Python flags.
        flipped_before = pre_mirror[k]
        if flipped_before:
            source = source.flip(-1)
        source = source.to(torch.float32)
        if tuple(source.shape[-2:]) == canvas_size:
            out.copy_(source)
        else:
            _bilinear(source, canvas_size, out)
        if mirror_here and flip[k] != flipped_before:
            out.copy_(out.flip(-1))

    def resize_and_finish(groups: Sequence[tuple[list[int], tuple[int, ...], tuple[int, ...]]]) -> None:
        # One sample per group; its canvas, this thread's own, is finished into the output.
        canvas = torch.empty((1, channels, ch, cw), dtype=torch.float32, device=device, memory_format=layout)
        for (k,), (y0, x0, h, w), _ in groups:  # every canvas is (ch, cw)
            if isinstance(images, torch.Tensor):
                source = images[k : k + 1, :, y0 : y0 + h, x0 : x0 + w]
            else:
                source = images[k][:, y0 : y0 + h, x0 : x0 + w].unsqueeze(0)
            resize_one(source, k, (ch, cw), canvas)
            for method, operand in steps:
                method(canvas, operand)
            output[k : k + 1].copy_(canvas.round_().clamp_(0, 255) if rounds else canvas)

    def resize_groups(groups: Sequence[tuple[list[int], tuple[int, ...], tuple[int, ...]]]) -> None:
        # Each group writes only its own samples' canvases: groups may run on separate threads.
        for ids, window, (ch, cw) in groups:
            y0, x0, h, w = window
            canvas_size = (ch, cw)
            first, count = ids[0], len(ids)
            if isinstance(images, torch.Tensor):
                source = images[:, :, y0 : y0 + h, x0 : x0 + w]
                if count == 1:
                    source = source[first : first + 1]
                elif count < n:
                    source = source.index_select(0, to_device([torch.tensor(ids)], device, staging)[0])
            elif count == 1:
                source = images[first][:, y0 : y0 + h, x0 : x0 + w].unsqueeze(0)
            else:
                source = torch.stack([images[k][:, y0 : y0 + h, x0 : x0 + w] for k in ids])
            if count == 1 and batch_canvas is not None:  # a random crop's sample: no tables at all
                resize_one(source, first, canvas_size, batch_canvas[first : first + 1])
                continue
            pre = [pre_mirror[k] for k in ids]
            if any(pre):
                source = _mirror_some(source, torch.tensor(pre), staging)
            source = source.to(torch.float32)
            mirrored = [flip[k] != p for k, p in zip(ids, pre)] if mirror_here else []
            mirror = torch.tensor(mirrored) if any(mirrored) else None
            if batch_canvas is None:
                resized = _resize(source, canvas_size, staging)
                for slot, k in enumerate(ids):
                    canvases[k] = resized[slot]
            elif count == 1 or count == n:  # ids is one sample or arange(n): a slice of the canvas
                _resize(source, canvas_size, staging, mirror, out=batch_canvas[first : first + count])
            else:
                batch_canvas.index_copy_(0, to_device([torch.tensor(ids)], device, staging)[0],
                                         _resize(source, canvas_size, staging, mirror))

    # Random crops make one small resize per image, too small for intra-op threads: spread
    # them over the usable CPUs instead (gpuload.cpu_threads).
    if finish is not None:
        spread_over_cpus(resize_and_finish, groups, device)
        return finish.out
    spread_over_cpus(resize_groups, groups, device)
    if batch_canvas is not None:
        if mirror_here:
            return batch_canvas
        return _gather(batch_canvas, maps.rows(from_window=False), maps.cols(from_window=False), fill, staging)
    made = [canvas for canvas in canvases if canvas is not None]
    assert len(made) == n  # the window groups cover every sample
    return _gather(made, maps.rows(from_window=False), maps.cols(from_window=False), fill, staging)


def _window_groups(
    images: torch.Tensor | Sequence[torch.Tensor], table: torch.Tensor, shared: bool = True
) -> list[tuple[list[int], tuple[int, ...], tuple[int, ...]]]:
    """(sample ids, window (y0, x0, h, w), canvas (h, w)) per distinct source window (and,
    for a list, per image: different images cannot share a call unless they have one shape);
    one group per sample when not ``shared``."""
    key = table[:, :6]
    if shared:
        if not isinstance(images, torch.Tensor):
            shapes = torch.tensor([tuple(image.shape[-2:]) for image in images], dtype=torch.int64)
            key = torch.cat([key, shapes], 1)
        if len(key) > 1 and bool((key == key[0]).all()):
            row = key[0].tolist()
            return [(list(range(len(key))), tuple(row[:4]), tuple(row[4:6]))]
        distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
        if len(distinct) < len(key):
            order = torch.argsort(inverse, stable=True)
            counts = torch.bincount(inverse, minlength=len(distinct)).tolist()
            return [(ids.tolist(), tuple(row[:4]), tuple(row[4:6]))
                    for row, ids in zip(distinct.tolist(), order.split(counts))]
    # every sample its own window (or its own group): no sorting needed
    return [([k], tuple(row[:4]), tuple(row[4:6])) for k, row in enumerate(key.tolist())]


def _resize(
    source: torch.Tensor,
    size: tuple[int, int],
    staging: Staging | None,
    mirror: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``source`` (G, C, h, w) float32 resized to ``size`` as the reference does (bilinear, no
    antialias; unchanged when already that size), then mirrored where ``mirror``; into ``out``
    when given."""
    same = tuple(source.shape[-2:]) == tuple(size)
    flips = mirror if mirror is not None and bool(mirror.any()) else None
    if out is None:
        resized = source if same else _bilinear(source, size)
        return _mirror_some(resized, flips, staging) if flips is not None else resized
    if same:
        out.copy_(source)
    else:
        _bilinear(source, size, out)
    return out.copy_(_mirror_some(out, flips, staging)) if flips is not None else out


def _canvas_format(images: torch.Tensor | Sequence[torch.Tensor]) -> torch.memory_format:
    """The layout the bilinear kernel gives these images' windows: channels_last for images
    stored channels-last (HWC decoder output), so that it writes the canvas directly; a
    canvas of the other layout costs a transposing copy per image (C innermost, 3 wide)."""
    first = images[:1] if isinstance(images, torch.Tensor) else images[0].unsqueeze(0)
    channels_last = first.is_contiguous(memory_format=torch.channels_last) and not first.is_contiguous()
    return torch.channels_last if channels_last else torch.contiguous_format


def _bilinear(source: torch.Tensor, size: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's resize kernel (``F.interpolate`` bilinear, align_corners=False, no
    antialiasing) on a float32 (G, C, h, w) batch, written into ``out`` when given."""
    # torch._C._nn: the aten kernel F.interpolate calls, without torch.ops' Python dispatch per call.
    if out is None:
        return torch._C._nn.upsample_bilinear2d(source, list(size), False, None)
    # the .out overload (scales_h, scales_w, out=), which torch's stubs do not list
    return torch._C._nn.upsample_bilinear2d(source, list(size), False, None, None, out=out)  # type: ignore[call-arg]


def _mirror_some(images: torch.Tensor, mirror: torch.Tensor, staging: Staging | None) -> torch.Tensor:
    """``images`` (G, C, H, W) with the samples where ``mirror`` (G,) mirrored left-right."""
    if bool(mirror.all()):
        return images.flip(-1)
    (flipped,) = to_device([mirror.nonzero()[:, 0]], images.device, staging)
    return images.index_copy(0, flipped, images.index_select(0, flipped).flip(-1))


def _mirrored_before_resize(params: BatchParams) -> torch.Tensor:
    """(N,) bool: samples an odd number of flips mirror before the (first) resize."""
    mirrored = torch.zeros(len(params.indices), dtype=torch.bool)
    for op, p in zip(params.ops, params.per_op):
        if isinstance(op, (RandomResizedCrop, Resize)):
            return mirrored
        if isinstance(op, RandomHorizontalFlip):
            mirrored ^= p["flip"]
    return torch.zeros_like(mirrored)
