"""A vLLM worker extension: seeded sampling across a prompt prefilled in several steps, and workers that idle, on CPU.

vLLM 0.32 samples a token for every request in a step, also for a prompt
chunk that is not the prompt's last; it drops that token and rewinds a
seeded request's random generator with ``Generator.set_offset`` (the CUDA
Philox counter). CPU generators have no offset, so a CPU engine dies
(``RuntimeError: CPU Generator does not use offset``) on any seeded request
whose prompt takes more than one step: every deflection in several chunks
(vLLM's own CPU server dies the same way on a seeded prompt longer than its
step budget).

``SeededChunks`` is mixed into a decode node's worker (vLLM's
``worker_extension_cls``); ``VllmEngine.start`` calls
``rewind_cpu_generators`` on it once. From then on the model runner saves
such a generator's state before sampling and puts it back afterwards in
place of vLLM's rewind, so the request's first real token is drawn from its
fresh seed, as after one unchunked step. CUDA generators keep vLLM's own
rewind.

After each step a vLLM worker spins on its shared-memory queue for a second
(``shm_broadcast.SpinCondition``) before it sleeps until the engine core
wakes it: the next step's instructions come sooner, and a GPU host has a core
to spare. CPU engines share their host's cores with each other, so that
second is taken from the other engines' steps. ``KairosWorker`` (every node's
extension) has ``spin_briefly`` cut the spin to ``IDLE_SPIN_S`` on CPU, long
enough to span the gap between one request's steps. Some spin must stay:
with none, vLLM 0.32's readers miss notifications sent in quick succession
(its publisher keeps at most one in flight) and sleep to their five-second
recheck.
"""

from __future__ import annotations

from typing import Any

import numpy as np

EXTENSION = "kairos_ray.engines.vllm_worker.KairosWorker"
IDLE_SPIN_S = 0.05  # a worker's busy wait for its next step before it sleeps, on CPU


class SeededChunks:
    """Mixed into vLLM's worker; ``model_runner`` is the worker's."""

    model_runner: Any

    def rewind_cpu_generators(self) -> None:
        """Make the model runner rewind seeded CPU generators of dropped samples by their saved state."""
        runner = self.model_runner
        sample_tokens, bookkeeping_sync = runner.sample_tokens, runner._bookkeeping_sync
        saved: dict[int, tuple[Any, Any]] = {}  # batch row -> (its generator, the state before this step's sample)

        def sample_saving_state(*args: Any, **kwargs: Any) -> Any:
            batch = runner.input_batch
            saved.clear()
            for row in np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]:
                generator = batch.generators.get(int(row))
                if generator is not None and generator.device.type == "cpu":
                    saved[int(row)] = (generator, generator.get_state())
            return sample_tokens(*args, **kwargs)

        def bookkeeping_restoring_state(*args: Any, **kwargs: Any) -> Any:
            generators = runner.input_batch.generators
            for row, (generator, state) in saved.items():
                generator.set_state(state)
                del generators[row]  # hidden from vLLM's offset rewind, which CPU generators do not have
            try:
                return bookkeeping_sync(*args, **kwargs)
            finally:
                generators.update({row: generator for row, (generator, _) in saved.items()})
                saved.clear()

        runner.sample_tokens = sample_saving_state
        runner._bookkeeping_sync = bookkeeping_restoring_state


def spin_briefly(seconds: float = IDLE_SPIN_S) -> float:
    """Make this process's readers of vLLM's shared-memory queues spin at most ``seconds`` before they sleep.

    vLLM spins for a second after each read; a reader that sleeps is woken by
    the writer's notification, so nothing waits longer, it only stops taking a
    core. Returns the bound now in effect.
    """
    from vllm.distributed.device_communicators import shm_broadcast

    condition: Any = shm_broadcast.SpinCondition
    if getattr(condition, "kairos_spin_s", None) is None:
        wait = condition.wait

        def wait_spinning_briefly(self: Any, timeout_ms: int | None = None) -> None:
            self.busy_loop_s = condition.kairos_spin_s
            wait(self, timeout_ms)

        condition.wait = wait_spinning_briefly
    condition.kairos_spin_s = seconds
    return float(seconds)


class KairosWorker(SeededChunks):
    """Every node's worker extension: ``SeededChunks`` (used by decode nodes) and idle CPU workers."""

    def spin_briefly(self) -> float | None:
        """``spin_briefly`` on a CPU worker (None elsewhere: GPU hosts keep vLLM's spin)."""
        from vllm.platforms import current_platform

        return spin_briefly() if current_platform.is_cpu() else None

    def spin_bound_s(self) -> float | None:
        """The bound on this worker process's spin after a step (None: vLLM's own)."""
        from vllm.distributed.device_communicators import shm_broadcast

        bound: float | None = getattr(shm_broadcast.SpinCondition, "kairos_spin_s", None)
        return bound
