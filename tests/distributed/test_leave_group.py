"""An entry script's process leaves its process group at exit (library/accelerator.py):
a gloo group left to C++ static destruction can abort a finished run with exit -6."""
import os
import subprocess
import sys
import textwrap

from library.accelerator import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the child reports whether its group still stands when the last atexit handler (registered
# first, so run last) looks
CHILD = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist
    from library.accelerator import leave_process_group_at_exit

    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
    leave_process_group_at_exit(finished=True)
    leave_process_group_at_exit(finished=True)  # once per process
    print("initialized after the run:", dist.is_initialized(), flush=True)
""")


def test_the_group_is_destroyed_at_exit_not_before():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", CHILD % free_port()], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines == ["initialized after the run: True", "initialized at exit: False"], p.stdout
