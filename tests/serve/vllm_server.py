"""vLLM's OpenAI server, whose workers sleep soon after their steps as the app's do.

``python -m tests.serve.vllm_server`` with the server's arguments.

vLLM spawns its engine core and workers, and each imports this module again as its main module, so each bounds its
shared-memory queue readers' spin (``kairos_ray.engines.vllm_worker.spin_briefly``); the answers are vLLM's own.
Otherwise the server's worker spins beside the app through the whole module, on cores the app's engines need.
"""

from kairos_ray.engines.vllm_worker import spin_briefly

spin_briefly()

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
