"""LossLog: losses kept on the device until read, read in one go, and the newest ready one without waiting."""

from __future__ import annotations

import pytest
import torch

from pipedream_ft.pipeline.losses import LossLog

pytestmark = pytest.mark.timeout(30)


class FakeDevice:
    """Stands in for a device's events: loss ``k`` is ready once ``done`` reaches ``k + 1``."""

    def __init__(self) -> None:
        self.done = 0
        self.issued = 0
        self.queries = 0

    def marker(self):
        k = self.issued
        self.issued += 1

        def ready() -> bool:
            self.queries += 1
            return self.done > k

        return ready


def test_on_the_cpu_each_loss_is_read_as_it_is_added():
    log = LossLog()
    log.add(0, torch.tensor(1.5))
    log.add(1, torch.tensor([0.25], dtype=torch.float64))
    assert log.pairs() == [(0, 1.5), (1, 0.25)] and log.latest() == 0.25 and log.last_minibatch() == 1
    with pytest.raises(ValueError):
        log.add(2, torch.ones(2))
    with pytest.raises(ValueError, match="minibatch 3 has 2 elements"):
        LossLog(marker=FakeDevice().marker).add(3, torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_losses_read_later_are_the_numbers_float_gives(dtype):
    device = FakeDevice()
    log = LossLog(marker=device.marker)
    values = [torch.randn((), generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(5)]
    for b, v in enumerate(values):
        log.add(10 + b, v.clone().requires_grad_() if dtype.is_floating_point else v)
    assert len(log) == 5 and log.last_minibatch() == 14
    assert log.pairs() == [(10 + b, float(v)) for b, v in enumerate(values)]  # bitwise, whatever the dtype


def test_latest_is_the_newest_ready_loss_and_never_waits():
    device = FakeDevice()
    log = LossLog([(0, 9.0)], marker=device.marker)
    for b in range(1, 5):
        log.add(b, torch.tensor(float(b)))
    assert log.latest() == 9.0  # nothing of the device's is ready yet: the restored one
    device.done = 2
    assert log.latest() == 2.0 and len(log) == 5
    device.done = 4
    queries = device.queries
    assert log.latest() == 4.0 and device.queries == queries + 1  # the newest ready: one query
    assert log.pairs() == [(0, 9.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert LossLog(marker=device.marker).latest() is None


def test_a_rewind_forgets_losses_to_be_computed_again_read_or_not():
    device = FakeDevice()
    log = LossLog(marker=device.marker)
    for b in range(6):
        log.add(b, torch.tensor(float(b)))
    device.done = 3
    log.latest()
    log.keep_before(2)
    assert log.pairs() == [(0, 0.0), (1, 1.0)]
    log.keep_before(0)
    assert log.pairs() == [] and log.last_minibatch() is None
    log.reset([(7, 0.5)])
    assert log.pairs() == [(7, 0.5)] and log.last_minibatch() == 7
