"""Run ``shardax`` paused at one moment of its life, so that a test can signal it exactly there.

    python tests/workers/pause.py MOMENT READY shardax train ...

MOMENT is one of:
- ``before-jax``: the command has started, JAX has not (``shardax train`` about to start it);
- ``swallowed``: the model is about to be laid out, and the exception the signal raises there is
  lost (as inside a finalizer or a library's callback): the command goes on, the signal still pending;
- ``restore``: a checkpoint is about to be restored (``--resume``);
- ``first-step``: the first step is about to be compiled and run;
- ``final-save``: the last step's checkpoint is about to be written.
On reaching it the process creates the file READY and waits (up to 120 s) until a stop signal
has reached it, then goes on as it would have. The test waits for READY, then signals: nothing
races the moment, however loaded the machine is.
"""

import importlib
import signal
import sys
import time
from pathlib import Path

import jax

from shardax.cli import signals
from shardax.errors import Stopped
from shardax.trainer import checkpoint, trainer

# the module (the package's `train` is the function)
train_command = importlib.import_module("shardax.cli.train")

MOMENT, READY, TARGET = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]


def signalled() -> bool:
    """A stop signal noted by the command line's handlers, or by the Trainer's (during ``fit``)."""
    handler = signal.getsignal(signal.SIGTERM)
    return bool(signals.received) or getattr(getattr(handler, "__self__", None), "received", None) is not None


def pause() -> None:
    READY.touch()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not signalled():
        time.sleep(0.02)


def before(function, moment, when=lambda *args, **kwargs: True):
    def paused(*args, **kwargs):
        if MOMENT == moment and when(*args, **kwargs) and not READY.exists():
            pause()
        return function(*args, **kwargs)

    return paused


def swallowing(function, moment):
    def paused(*args, **kwargs):
        if MOMENT == moment and not READY.exists():
            try:
                pause()
            except Stopped:
                pass
        return function(*args, **kwargs)

    return paused


train_command._join_cluster = before(train_command._join_cluster, "before-jax")
trainer.Trainer.__init__ = swallowing(trainer.Trainer.__init__, "swallowed")
checkpoint.Checkpointer.restore = before(checkpoint.Checkpointer.restore, "restore")
original_train_step = trainer.Trainer.train_step


def train_step(self, *args, **kwargs):
    def called(state, batch):  # not traced (``check_step`` traces the step on shapes first)
        return not isinstance(jax.tree.leaves(batch)[0], jax.core.Tracer)

    return before(original_train_step(self, *args, **kwargs), "first-step", when=called)


trainer.Trainer.train_step = train_step
FINAL = int(TARGET[TARGET.index("--steps") + 1]) if "--steps" in TARGET else None
checkpoint.Checkpointer.save = before(checkpoint.Checkpointer.save, "final-save",
                                      when=lambda self, step, *args, **kwargs: step == FINAL)

from shardax.cli import main  # noqa: E402

sys.exit(main(TARGET[1:]))
