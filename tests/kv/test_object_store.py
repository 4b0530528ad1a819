"""The object store's pins: a pin whose release never comes expires, on an idle node too."""

import gc
import weakref

from kairos_ray.kv.object_store import KVPins


class Payload:
    """Stands in for the ``ObjectRef`` a prefill node pins: what matters is that the pin lets it go."""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_pin_never_released_expires_when_read_without_any_later_pin():
    clock = Clock()
    pins = KVPins(pin_s=120.0, clock=clock)
    payload = Payload()
    alive = weakref.ref(payload)
    pins.pin(7, payload)
    del payload
    clock.now += 119.0
    assert len(pins) == 1  # still within its pin
    clock.now += 2.0
    assert len(pins) == 0  # the node's next report reads it: gone, no new hand-off needed
    gc.collect()
    assert alive() is None  # and the reference went with it


def test_pins_expire_oldest_first_and_a_released_pin_is_gone_at_once():
    clock = Clock()
    pins = KVPins(pin_s=10.0, clock=clock)
    pins.pin(1, Payload())
    clock.now += 6.0
    pins.pin(2, Payload())
    pins.pin(3, Payload())
    pins.release(3)
    assert len(pins) == 2
    clock.now += 5.0  # 1 is 11 s old, 2 is 5 s old
    assert len(pins) == 1
    pins.pin(1, Payload())  # a re-pin starts its time again
    clock.now += 6.0  # 2 is 11 s old, 1 is 6 s old
    assert len(pins) == 1
    pins.release(1)
    assert len(pins) == 0
