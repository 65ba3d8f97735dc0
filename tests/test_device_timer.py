"""The GPU's own split of the hot loop (measurement/device_timer.py): CUDA events between the forward and the metric
updates, read only once finished, so the host never waits for them per batch. Here the events are stand-ins that
say when they finished; the engine's wiring is checked by a run whose timer records stand-in events."""

import pytest

from repgeom_eval.measurement import device_timer as dt
from repgeom_eval.measurement.engine import measure


class Clock:
    def __init__(self):
        self.now = 0.0  # seconds on the "device"
        self.done_until = float("inf")  # events recorded after this have not finished
        self.events = []

    def new(self):
        return Event(self)

    def record(self, event):
        event.t = self.now
        self.events.append(event)


class Event:
    def __init__(self, clock):
        self.clock, self.t, self.waited = clock, None, False

    def query(self):
        return self.t <= self.clock.done_until

    def synchronize(self):
        self.waited = True

    def elapsed_time(self, end):
        assert end.query() or end.waited, "read before it finished: CUDA raises cudaErrorNotReady"
        return (end.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event.elapsed_time


def test_stages_are_charged_the_time_since_the_previous_mark():
    clock = Clock()
    timer = dt.DeviceTimer(clock.new, clock.record)
    for start in (0.0, 10.0):  # two batches: forward 1 s, metrics 3 s, then a gap charged to nothing
        clock.now = start
        timer.mark(None)
        clock.now = start + 1
        timer.mark("forward")
        clock.now = start + 4
        timer.mark("metrics")
    assert timer.seconds() == pytest.approx({"forward": 2.0, "metrics": 6.0})


def test_unfinished_events_are_not_read_until_the_end():
    clock = Clock()
    clock.done_until = 0.5  # only the first mark has finished on the device
    timer = dt.DeviceTimer(clock.new, clock.record)
    for t, stage in ((0.0, None), (1.0, "forward"), (3.0, "metrics")):
        clock.now = t
        timer.mark(stage)
    assert timer.totals == {} and len(timer._pending) == 2  # nothing waited for during the loop
    assert not any(e.waited for e in clock.events)
    assert timer.seconds() == pytest.approx({"forward": 1.0, "metrics": 2.0})
    clock.done_until = float("inf")
    timer.reset()
    assert timer.seconds() == {}


def test_no_timer_on_the_cpu(tiny_model_dir):
    from repgeom_eval.modeling.loading import load_model

    timer = dt.DeviceTimer.for_model(load_model(tiny_model_dir("llama"), device="cpu"))
    assert timer is dt.NO_DEVICE_TIMER
    timer.mark("forward")
    assert timer.seconds() == {}


@pytest.mark.parametrize("threads, marks", [(2, 3), (1, 2 + 2 * 3)], ids=["fed-after-the-pass", "fed-during-it"])
def test_a_run_reports_the_device_split(tiny_model_dir, texts, monkeypatch, threads, marks):
    # fed after the pass: start, forward, metrics; fed during it (as on a GPU): start, then each of the 3 addresses
    # closes a forward stretch and its metric work, and the pass's tail after the last one is the forward's
    from repgeom_eval.measurement.engine import MeasureRun

    monkeypatch.setattr(MeasureRun, "_metric_threads", lambda self, host: threads)
    clock = Clock()
    model = tiny_model_dir("llama")

    def run():
        return measure(model, texts[:6], layers="all", metrics=["dispersion"], batch_size=2, progress=False)

    plain = run()
    assert "forward_device_s" not in plain.timings  # on the CPU, no device timer
    monkeypatch.setattr(dt.DeviceTimer, "for_model", staticmethod(lambda loaded: dt.DeviceTimer(clock.new,
                                                                                                 clock.record)))
    timed = run()
    assert len(clock.events) == marks * 3  # three batches
    assert {"forward_device_s", "metrics_device_s"} <= set(timed.timings)
    assert timed.results == plain.results
