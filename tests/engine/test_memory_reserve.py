"""engine.MemoryReserve: memory held back for a retry after an out-of-memory. A forward that
runs out hands it back before the scheduler splits the batch (so the half, and anything a
library allocates outside torch's allocator for it, finds room), and the next forward that fits
takes it again. On a CPU the server keeps none; here a CPU tensor stands in for the device's."""

from __future__ import annotations

import weakref

import pytest
import torch

from gpt2serve.engine import engine as engine_module
from gpt2serve.engine.engine import MemoryReserve, OutOfMemory, oom_as_out_of_memory


class Forward:
    def __init__(self):
        self.fail_next = False

    @oom_as_out_of_memory
    def __call__(self) -> str:
        if self.fail_next:
            self.fail_next = False
            assert engine_module.RESERVE.held is not None  # still held while the forward runs
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return "answer"


@pytest.fixture
def reserve(monkeypatch):
    reserve = MemoryReserve()
    monkeypatch.setattr(engine_module, "RESERVE", reserve)
    reserve.keep(torch.device("cpu"), 4096)
    return reserve


def test_an_out_of_memory_hands_the_reserve_back_and_a_forward_that_fits_takes_it_again(reserve):
    forward = Forward()
    assert forward() == "answer" and reserve.held is not None and reserve.held.numel() == 4096
    forward.fail_next = True
    with pytest.raises(OutOfMemory, match="Tried to allocate 2.00 GiB"):
        forward()
    assert reserve.held is None and reserve.missing  # handed back before the split half runs
    assert forward() == "answer"
    assert reserve.held is not None and not reserve.missing


def test_a_reserve_that_cannot_be_taken_again_is_tried_after_each_forward(reserve, monkeypatch):
    forward = Forward()
    forward.fail_next = True
    with pytest.raises(OutOfMemory):
        forward()
    real_empty = torch.empty

    def still_full(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("still full")

    monkeypatch.setattr(torch, "empty", still_full)
    assert forward() == "answer" and reserve.missing  # the answer is not lost to the reserve
    monkeypatch.setattr(torch, "empty", real_empty)
    assert forward() == "answer" and reserve.held is not None and not reserve.missing



def test_the_failed_forwards_tensors_are_freed_before_the_caller_retries(reserve):
    """The scheduler retries each half inside its handler for OutOfMemory. If torch's exception
    (its traceback, the failed forward's frames, their activations) were still alive there,
    every retry would run with the failed attempt's memory held: on an H100 a 64-prompt batch
    split down to one prompt and that one failed too, with 8x its own peak free beforehand."""
    activations = []

    class Failing:
        @oom_as_out_of_memory
        def __call__(self):
            hidden = torch.empty(1024)  # what a forward holds when it runs out
            activations.append(weakref.ref(hidden))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")

    try:
        Failing()()
    except OutOfMemory as exc:
        assert activations[0]() is None, "the failed forward's tensors are still alive where the caller retries"
        assert exc.__context__ is None
    else:
        pytest.fail("no OutOfMemory")
