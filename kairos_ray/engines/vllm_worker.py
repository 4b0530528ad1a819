"""A vLLM worker extension for decode nodes: seeded sampling across a prompt prefilled in several steps, on CPU.

vLLM 0.32 samples a token for every request in a step, also for a prompt
chunk that is not the prompt's last; it drops that token and rewinds a
seeded request's random generator with ``Generator.set_offset`` (the CUDA
Philox counter). CPU generators have no offset, so a CPU engine dies
(``RuntimeError: CPU Generator does not use offset``) on any seeded request
whose prompt takes more than one step: every deflection in several chunks
(vLLM's own CPU server dies the same way on a seeded prompt longer than its
step budget).

``SeededChunks`` is mixed into the worker (vLLM's ``worker_extension_cls``);
``VllmEngine.start`` calls ``rewind_cpu_generators`` on it once. From then
on the model runner saves such a generator's state before sampling and puts
it back afterwards in place of vLLM's rewind, so the request's first real
token is drawn from its fresh seed, as after one unchunked step. CUDA
generators keep vLLM's own rewind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

EXTENSION = "kairos_ray.engines.vllm_worker.SeededChunks"


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
