"""``spin_briefly`` on vLLM's own shared-memory queue reader (no engine): an idle reader sleeps, it does not spin."""

import time

import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from kairos_ray.engines.vllm_worker import IDLE_SPIN_S, spin_briefly


def test_a_reader_idle_past_the_bound_sleeps_until_notified_instead_of_spinning():
    context = zmq.Context()
    reader = SpinCondition(is_reader=True, context=context, notify_address=get_open_zmq_ipc_path())
    try:
        assert reader.busy_loop_s > 4 * IDLE_SPIN_S  # vLLM's own spin, which would return at once below
        assert spin_briefly() == IDLE_SPIN_S
        reader.last_read = time.monotonic() - 4 * IDLE_SPIN_S  # its last read, longer ago than the bound
        started = time.monotonic()
        reader.wait(timeout_ms=300)  # nothing notifies: it sleeps the whole timeout
        assert time.monotonic() - started >= 0.25
    finally:
        for socket in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket):
            socket.close(linger=0)
        context.term()
