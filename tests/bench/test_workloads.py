"""Workloads: sizes stated before allocation, deterministic batches, refusal when too big."""

from __future__ import annotations

import time
from collections import namedtuple

import psutil
import pytest
import torch

from nbckpt import ConfigError
from nbckpt._util import MIB, format_bytes
from nbckpt.bench import _workloads as wl
from nbckpt.bench._strategy import plain_state, tensor_bytes

# Approximate parameter counts the preset names promise.
EXPECTED_PARAMS = {
    "tiny": 1e6,
    "small": 25e6,
    "base": 125e6,
    "350m": 350e6,
    "1b": 1e9,
    "3b": 3e9,
}


@pytest.mark.parametrize("name", list(EXPECTED_PARAMS))
def test_preset_sizes_match_their_names_without_allocating(name: str) -> None:
    workload = wl.gpt(name)
    assert not workload.built
    assert 0.75 * EXPECTED_PARAMS[name] <= workload.params <= 1.25 * EXPECTED_PARAMS[name]
    # model + two AdamW moments in fp32, plus one step counter per tensor
    assert workload.nbytes == 12 * workload.params + 4 * workload.config.param_tensors()
    text = workload.describe()
    assert f"{workload.params / 1e6:.1f}M parameters" in text
    assert format_bytes(workload.nbytes) in text


def test_tiny_builds_with_the_stated_parameters_and_checkpoint_size() -> None:
    workload = wl.gpt("tiny")
    workload.build()
    assert workload.model is not None
    assert sum(p.numel() for p in workload.model.parameters()) == workload.params
    state = workload.state()
    assert set(state) == {"model", "optim", "step"}
    assert tensor_bytes(plain_state(state)) == workload.nbytes
    assert state["step"] == 0


def test_batches_depend_only_on_seed_and_step() -> None:
    first, again, other = wl.gpt("tiny", seed=1), wl.gpt("tiny", seed=1), wl.gpt("tiny", seed=2)
    inputs, targets = first.batch(3)
    assert torch.equal(inputs, again.batch(3)[0])
    assert torch.equal(targets, again.batch(3)[1])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(inputs, first.batch(4)[0])
    assert not torch.equal(inputs, other.batch(3)[0])
    assert int(inputs.max()) < first.config.vocab


def test_training_is_deterministic_and_hook_runs_before_the_update() -> None:
    runs = []
    for _ in range(2):
        workload = wl.gpt("tiny", seed=5)
        workload.build()
        assert workload.model is not None
        seen: list[tuple[bool, torch.Tensor]] = []
        weight = workload.model.tok.weight

        def hook(weight: torch.Tensor = weight, seen: list[tuple[bool, torch.Tensor]] = seen) -> None:
            seen.append((weight.grad is not None, weight.detach().clone()))

        workload.train_step(hook)
        workload.train_step()
        ((had_grad, before),) = seen
        assert had_grad
        assert not torch.equal(before, weight)  # the optimizer step came after the hook
        assert workload.step == 2
        runs.append(weight.detach().clone())
    assert torch.equal(runs[0], runs[1])


def test_synthetic_state_has_exactly_the_bytes_asked_for() -> None:
    workload = wl.SyntheticWorkload(MIB + 3, compute_ms=1.0)
    workload.build()
    state = workload.state()
    assert tensor_bytes(plain_state(state)) == MIB + 3 == workload.nbytes
    first = state["model"]["t0000"].clone()
    workload.train_step()
    assert not torch.equal(first, workload.state()["model"]["t0000"])
    assert workload.state()["step"] == 1
    assert wl.synthetic(2.5).nbytes == int(2.5 * MIB)


def test_absurd_sizes_are_refused_before_allocating() -> None:
    with pytest.raises(ConfigError, match="host memory"):
        wl.synthetic(1e9).build()  # a petabyte


def test_presets_refuse_when_free_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    Memory = namedtuple("Memory", "available total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory(100 * MIB, 100 * MIB))
    workload = wl.gpt("tiny")
    with pytest.raises(ConfigError, match=r"gpt-tiny needs about .* only 104\.9 MB is free"):
        workload.build()
    assert workload.model is None


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: wl.gpt("huge"), "unknown preset 'huge'"),
        (lambda: wl.make_workload("tiny", 4.0), "not both"),
        (lambda: wl.synthetic(-1), "size_mb must be a positive number"),
        (lambda: wl.synthetic(1, compute_ms=float("nan")), "compute_ms"),
        (lambda: wl.gpt("tiny", device="tpu"), "device must be 'cpu' or 'cuda'"),
        (lambda: wl.gpt("tiny").train_step(), "not built yet"),
    ],
)
def test_bad_arguments_raise_config_error(call: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()  # type: ignore[operator]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_without_a_device_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no CUDA device"):
        wl.gpt("tiny", device="cuda")


def test_make_workload_defaults_to_tiny_and_takes_sizes() -> None:
    assert wl.make_workload().name == "tiny"
    synthetic = wl.make_workload(size_mb=3, compute_ms=0)
    assert isinstance(synthetic, wl.SyntheticWorkload)
    assert synthetic.nbytes == 3 * MIB
    assert synthetic.compute_ms == 0


def test_idle_compute_leaves_the_host_idle_through_the_steps_compute() -> None:
    """The stand-in for device compute takes no CPU of the step's thread; the matmuls do."""
    idle, busy = wl.synthetic(1, compute_ms=20, idle_compute=True), wl.synthetic(1, compute_ms=20)
    cpu_s = {}
    for name, workload in (("idle", idle), ("busy", busy)):
        workload.build()
        begin = time.thread_time()
        for _ in range(3):
            workload.train_step()
        cpu_s[name] = time.thread_time() - begin
    assert cpu_s["idle"] * 5 < cpu_s["busy"], cpu_s
    assert idle.step == busy.step == 3
    assert "20 ms per step of device compute, the host idle through it" in idle.describe()
    assert "the host idle" not in busy.describe()
    made = wl.make_workload(size_mb=1, compute_ms=20, idle_compute=True)
    assert isinstance(made, wl.SyntheticWorkload) and made.idle_compute


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: wl.make_workload("tiny", idle_compute=True), "give size_mb, not a preset"),
        (lambda: wl.synthetic(1, compute_ms=0, idle_compute=True), "give compute_ms > 0"),
    ],
)
def test_idle_compute_without_a_synthetic_states_compute_is_refused(call: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()  # type: ignore[operator]
