"""Run a program with ``Trainer.fit`` pausing after a given step, so a test can signal or kill it there.

    python tests/workers/stall.py STEP SECONDS shardax train ...
    python tests/workers/stall.py STEP SECONDS examples/classify_digits.py ...

After logging step STEP the run waits up to SECONDS, ending the wait early once a stop signal
has reached the Trainer in this process, or once the file named by ``STALL_RELEASE`` exists
(with several processes JAX's preemption service keeps SIGTERM, so the test releases them
itself); then it goes on. A test waits for STEP in the metrics file and acts then, however
loaded the machine is: nothing races the end of a short run.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

from shardax.trainer import trainer as trainer_module

STEP, SECONDS, TARGET = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]


RELEASE = os.environ.get("STALL_RELEASE")


def stop_requested():
    if RELEASE and Path(RELEASE).exists():
        return True
    handler = signal.getsignal(signal.SIGTERM)
    return getattr(getattr(handler, "__self__", None), "received", None) is not None


original_fit = trainer_module.Trainer.fit


def fit(self, *args, on_log=None, **kwargs):
    def log(record):
        if on_log is not None:
            on_log(record)
        if record["step"] == STEP:
            deadline = time.monotonic() + SECONDS
            while time.monotonic() < deadline and not stop_requested():
                time.sleep(0.02)

    return original_fit(self, *args, on_log=log, **kwargs)


trainer_module.Trainer.fit = fit
if TARGET[0] == "shardax":
    from shardax.cli import main

    sys.exit(main(TARGET[1:]))
sys.argv = TARGET
runpy.run_path(TARGET[0], run_name="__main__")
