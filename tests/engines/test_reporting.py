"""A node reports what decisions depend on, not every step: pushes on a taken request or a change of shape."""

from kairos_ray.core import DecodeNodeView
from kairos_ray.engines.reporting import StateReporter


def test_a_push_goes_when_the_router_learns_something_and_carries_every_step_since():
    pushed = []
    view = {"batch": 1, "kv": 100}
    reporter = StateReporter("host", None, pushed.append, interval_s=0.0, refresh_s=3600.0)
    reporter.snapshot = lambda: reporter.state(DecodeNodeView("decode-0", view["batch"], view["kv"], 10_000))
    reporter.report()  # the first report: a shape the router has not seen
    assert len(pushed) == 1
    for _ in range(5):  # decode steps: only the KV grows
        view["kv"] += 1
        reporter.stepped(1, view["kv"], 0, 0.02)
        reporter.report()
    assert len(pushed) == 1
    reporter.accepted(7)  # a request taken: the router's ledger must hear of it
    reporter.report()
    assert len(pushed) == 2 and pushed[1].accepted_request_ids == (7,) and len(pushed[1].steps) == 5
    view["batch"] = 2  # the batch changed
    reporter.report()
    assert len(pushed) == 3 and pushed[2].view.batch_size == 2 and pushed[2].accepted_request_ids == ()
    reporter.report(force=True)  # the heartbeat
    assert len(pushed) == 4
