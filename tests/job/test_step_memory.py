"""The step's memory estimate: linear in the batch, model state counted once, and (on a GPU)
close to what CUDA's allocator actually peaks at."""

from __future__ import annotations

import job_models as M
import pytest
import torch
from torch import nn

from gpuload.job.step_memory import StepMemory, StepTrace, StepTracer, estimate_step_memory


def _bytes(tensors, device: str = "cpu") -> int:
    """What the tracer counts for these tensors: CUDA's allocator rounds each to 512 bytes."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    return sum(-(-size // 512) * 512 for size in sizes) if device == "cuda" else sum(sizes)


def _param_bytes(model: nn.Module, device: str = "cpu") -> int:
    return _bytes(model.parameters(), device)


def _step_scalars(model: nn.Module, device: str) -> int:
    """Adam's float32 "step" per parameter tensor: on the trace device only off CUDA (on CUDA it
    stays on the host)."""
    return 4 * len(list(model.parameters())) if device == "cpu" else 0


@pytest.fixture(scope="module")
def cnn_adamw() -> tuple[nn.Module, StepMemory]:
    model = M.cnn()
    return model, estimate_step_memory(model, M.SAMPLES["cnn"](), optimizer="adamw", batch_sizes=(4, 16, 64))


def test_peak_is_monotone_and_close_to_linear(cnn_adamw) -> None:
    _, memory = cnn_adamw
    peaks = [t.peak for t in memory.traces]
    assert peaks == sorted(peaks) and len(set(peaks)) == 3
    assert memory.per_sample > 0
    # the line through 16 and 64 predicts 4 within 2%
    assert memory.residual < 0.02
    assert all(memory.peak(b) <= memory.peak(b + 1) for b in range(1, 200))
    # per sample: at least the input and the first conv's output (3x32x32 and 16x32x32 floats)
    assert memory.per_sample > (3 + 16) * 32 * 32 * 4


def test_adamw_state_is_parameters_gradients_and_two_moments_once(cnn_adamw) -> None:
    model, memory = cnn_adamw
    params = _param_bytes(model, memory.device)
    state = memory.state
    assert state["parameters"] == params
    assert state["gradients"] == params
    # exp_avg + exp_avg_sq, plus one float32 "step" scalar per parameter tensor
    assert state["optimizer state"] == 2 * params + _step_scalars(model, memory.device)
    assert state["buffers"] == _bytes(model.buffers(), memory.device)
    # the fixed part holds the parameters and the optimizer state, not several copies of them
    assert 3 * params <= memory.fixed + memory.per_sample < 5 * params + memory.per_sample


@pytest.mark.parametrize(("optimizer", "moments"), [("sgd", 1), (None, 0), (torch.optim.Adam, 2)])
def test_other_optimizers_hold_their_own_state(optimizer, moments: int) -> None:
    model = M.mlp()
    memory = estimate_step_memory(model, M.SAMPLES["mlp"](), optimizer=optimizer, batch_sizes=(8, 32))
    params = _param_bytes(model, memory.device)
    steps = _step_scalars(model, memory.device) if optimizer is torch.optim.Adam else 0
    assert memory.state["parameters"] == memory.state["gradients"] == params
    assert memory.state["optimizer state"] == moments * params + steps


def test_optimizer_instance_keeps_its_groups_and_the_real_model_is_untouched() -> None:
    model = M.mlp()
    before = [p.detach().clone() for p in model.parameters()]
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    optimizer = torch.optim.SGD([{"params": first, "momentum": 0.9}, {"params": rest}], lr=0.1)
    tracer = StepTracer(model, M.SAMPLES["mlp"](), optimizer=optimizer)
    trace = tracer.trace(8)
    assert trace.state["optimizer state"] == _bytes(first, tracer.device.type)  # momentum only in group 0
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))
    assert optimizer.state == {}  # the user's optimizer never stepped


def test_factory_and_instance_trace_the_same() -> None:
    sample = M.SAMPLES["cnn"]()
    built = StepTracer(M.cnn, sample, optimizer="adamw").trace(8)
    copied = StepTracer(M.cnn(), sample, optimizer="adamw").trace(8)
    assert built.peak == copied.peak and built.state == copied.state


def test_a_later_batch_size_runs_only_the_traced_step_and_traces_what_a_fresh_tracer_does() -> None:
    """The tracer keeps its fake model and optimizer in the steady state: a second batch size
    costs one step, not two, and its trace is the one a new tracer makes at that size."""
    steps: list[int] = []
    model = M.cnn()
    model.register_forward_pre_hook(lambda module, args: steps.append(args[0].shape[0]))
    tracer = StepTracer(model, M.SAMPLES["cnn"](), optimizer="adamw")
    tracer.trace(4)
    later = tracer.trace(16)
    assert steps == [4, 4, 16]
    fresh = StepTracer(M.cnn(), M.SAMPLES["cnn"](), optimizer="adamw").trace(16)
    assert (later.peak, later.at_peak, later.state) == (fresh.peak, fresh.at_peak, fresh.state)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_the_whole_step_tracker_finds_memtrackers_peak_and_its_kinds(name: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracer skips MemTracker's per-module peaks (half a ResNet-50 trace's time): the step's
    peak and its kinds at the peak and after the update are MemTracker's own."""
    import gpuload.job.step_memory as step_memory

    def traces() -> list[StepTrace]:
        tracer = StepTracer(getattr(M, name), M.SAMPLES[name](), optimizer="adamw", autocast=torch.bfloat16)
        return [tracer.trace(b) for b in (2, 8)]

    ours = traces()
    monkeypatch.setattr(step_memory, "_whole_step_tracker", lambda tracker: tracker)
    theirs = traces()
    assert [(t.peak, t.at_peak, t.state) for t in ours] == [(t.peak, t.at_peak, t.state) for t in theirs]


def test_token_inputs_and_a_transformer() -> None:
    memory = estimate_step_memory(M.transformer, M.SAMPLES["transformer"](), optimizer="adamw", batch_sizes=(4, 8))
    assert memory.traces[1].peak > memory.traces[0].peak
    assert memory.state["optimizer state"] >= 2 * memory.state["parameters"]


def test_loss_fn_and_tuple_inputs() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(10, 4), nn.Linear(6, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(y)

    def cross_entropy(logits: torch.Tensor) -> torch.Tensor:
        target = torch.zeros(len(logits), dtype=torch.long, device=logits.device)
        return nn.functional.cross_entropy(logits, target)

    trace = StepTracer(TwoInputs(), (torch.empty(10), torch.empty(6)), loss_fn=cross_entropy).trace(16)
    assert trace.peak >= 16 * (10 + 6) * 4


def test_autocast_halves_the_activations_not_the_model_state() -> None:
    sample = M.SAMPLES["cnn"]()
    full = estimate_step_memory(M.cnn, sample, optimizer="adamw", batch_sizes=(8, 64))
    half = estimate_step_memory(M.cnn, sample, optimizer="adamw", batch_sizes=(8, 64), autocast=torch.bfloat16)
    assert half.state == full.state  # fp32 parameters, gradients and moments either way
    assert 0.4 * full.per_sample < half.per_sample < 0.9 * full.per_sample
    with pytest.raises(ValueError, match="autocast"):
        StepTracer(M.cnn, sample, autocast=torch.int8)


def test_fit_keeps_a_floor_below_the_line() -> None:
    flat = dict(parameters=0)
    traces = [StepTrace(b, peak, {}, flat, 0.0) for b, peak in ((8, 1000), (32, 1100), (128, 2100))]
    memory = StepMemory.fit(traces, "cpu")
    assert memory.per_sample == pytest.approx(1000 / 96)
    assert memory.peak(8) == 1000 and memory.peak(128) == 2100  # the optimizer step's floor at small batches
    with pytest.raises(ValueError, match="two or more"):
        StepMemory.fit(traces[:1], "cpu")


def test_bad_inputs_say_what_to_pass() -> None:
    with pytest.raises(TypeError, match="sample must be a tensor"):
        StepTracer(M.mlp(), [1, 2, 3])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        StepTracer("resnet", torch.empty(3))
    with pytest.raises(ValueError, match="not one of"):
        StepTracer(M.mlp(), torch.empty(784), optimizer="lion").trace(2)
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        StepTracer(lambda: 3, torch.empty(784)).trace(2)
    with pytest.raises(ValueError, match="^batch_size must be at least 1, got 0$"):
        StepTracer(M.mlp(), torch.empty(784)).trace(0)
    with pytest.raises(ValueError, match=r"^autocast=torch.float64: use torch.bfloat16, torch.float16 or None$"):
        StepTracer(M.mlp(), torch.empty(784), autocast=torch.float64)
    with pytest.raises(TypeError, match="^optimizer=3: give a name "):
        StepTracer(M.mlp(), torch.empty(784), optimizer=3).trace(2)  # type: ignore[arg-type]
    real = M.mlp()
    with pytest.raises(TypeError, match="^an optimizer instance needs the model instance it was built for, not a "
                       "factory$"):
        StepTracer(M.mlp, torch.empty(784), optimizer=torch.optim.SGD(real.parameters(), lr=0.1)).trace(2)
    with pytest.raises(ValueError, match="^the model's output holds no floating-point tensor to take a loss of; "
                       "pass loss_fn$"):
        StepTracer(_Argmax(), torch.empty(784)).trace(2)


class _Argmax(nn.Module):
    """A model whose output is integer class indices: no default loss can be taken of it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(784, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).argmax(dim=1)


# ------------------------------------------------------------------ on a GPU: against CUDA's allocator


def _measured_peak(name: str, batch_size: int) -> int:
    """Bytes CUDA's allocator peaks at over two AdamW steps, from an empty allocator."""
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model = M.FACTORIES[name]().to(device).train()
    optimizer = torch.optim.AdamW(model.parameters())
    sample = M.SAMPLES[name]()
    batch = torch.zeros((batch_size, *sample.shape), dtype=sample.dtype, device=device)
    for _ in range(2):
        output = model(batch)
        output.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del output
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    del model, optimizer, batch
    torch.cuda.empty_cache()
    return peak


@pytest.mark.gpu
# batch sizes where each step peaks near 0.7 GiB, so workspaces stay small beside it
@pytest.mark.parametrize(("name", "batch_size"), [("cnn", 2048), ("mlp", 65536), ("transformer", 512)])
def test_estimate_within_ten_percent_of_cuda_peak(name: str, batch_size: int) -> None:
    estimate = StepTracer(M.FACTORIES[name], M.SAMPLES[name](), optimizer="adamw").trace(batch_size).peak
    measured = _measured_peak(name, batch_size)
    assert abs(estimate - measured) <= 0.10 * measured, (name, estimate, measured)


def test_a_torch_without_memtracker_is_one_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import re
    import sys

    monkeypatch.setitem(sys.modules, "torch.distributed._tools.mem_tracker", None)
    with pytest.raises(RuntimeError, match=r"^estimating a step's memory needs torch.distributed's MemTracker, which "
                       rf"this torch \({re.escape(torch.__version__)}\) lacks: "
                       r"import of torch.distributed._tools.mem_tracker halted"):
        StepTracer(M.mlp(), torch.empty(784))


def test_only_the_traced_devices_bytes_are_counted() -> None:
    from gpuload.job.step_memory import _kinds

    snapshot = {"cpu": {"Parameter": 100, "Temp": 4}, "cuda:0": {"Parameter": 7}}
    assert _kinds(snapshot, torch.device("cpu")) == {"parameters": 100, "temporaries": 4}
