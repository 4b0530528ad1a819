"""``kairos_ray.heap``: a process's start-up heap frozen out of full garbage collections."""

import subprocess
import sys
import textwrap

# In a child process: freezing is for the process's whole life, and pytest's own heap is not under test.
CHILD = textwrap.dedent(
    """
    import gc, logging, weakref
    from ray import serve  # a replica's imports, roughly
    from kairos_ray.heap import freeze_startup_heap

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # start-up garbage only a full collection frees
    gone = weakref.ref(cycle)
    del cycle
    kept = Node()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    frozen = freeze_startup_heap("child", logging.getLogger("test"))
    assert gone() is None, "start-up garbage was frozen instead of collected"
    assert gc.get_freeze_count() == frozen.objects > 100_000, frozen
    assert not any(o is kept for o in gc.get_objects()), "a start-up object is still in a collected generation"
    fresh = Node()
    assert any(o is fresh for o in gc.get_objects()), "objects made after start-up are collected as before"
    walked = len(gc.get_objects())
    assert walked < frozen.objects / 10, (walked, frozen.objects)  # what a full collection walks now
    print(f"walked {walked} of {frozen.objects}")
    """
)


def test_start_up_objects_leave_the_collected_generations_and_garbage_goes_first():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "child: froze" in result.stderr and "a full garbage collection took" in result.stderr, result.stderr
