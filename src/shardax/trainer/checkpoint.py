"""Checkpoints with orbax: asynchronous saves, restores straight into a target layout.

A checkpoint holds the whole ``TrainState`` in its item ``state``, saved with orbax's ``StandardSave`` as the
tree ``{"params": nnx.State, "rest": nnx.State, "opt_state": ..., "step": ..., "skipped": ...}`` (``params``:
the model's ``nnx.Param`` state, ``rest``: its other variables, RNG keys included), a JSON record (data
position, the run's settings) and, when the data comes from Grain, each process's iterator state. Restoring
into another strategy or mesh is restoring into that layout's abstract state: orbax reads each device's pieces
where they now belong. orbax alone restores a model from it into ``nnx.state(model)`` (docs/your-model.md).
Checkpoints written before this layout (a flat dict of dotted names, RNG keys as raw bits) still load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from shardax.errors import UsageError
from shardax.sharding.paths import path_to_str
from shardax.trainer.lock import DirectoryLock
from shardax.trainer.manifest import damage, seal, seal_part

logger = logging.getLogger(__name__)


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _flat_name(keypath: Any) -> str:
    return path_to_str(keypath).replace("/", ".")


def flatten_state(tree: Any) -> dict[str, Any]:
    """``{"params.blocks.qkv": leaf, ...}``: the flat dict older checkpoints hold (keys as bits)."""
    def stored(leaf: Any) -> Any:
        if not _is_key(leaf):
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):
            data = jax.eval_shape(jax.random.key_data, leaf)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=_key_data_sharding(leaf.sharding))
        return jax.random.key_data(leaf)

    return {_flat_name(keypath): stored(leaf) for keypath, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _key_data_sharding(sharding: Any) -> Any:
    """A key's raw bits add a trailing dimension, which stays whole."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec))
    return sharding


def unflatten_state(template: Any, flat: dict[str, Any]) -> Any:
    """Put ``flat``'s arrays back into ``template``'s structure (same paths; RNG keys wrapped)."""
    keypaths, treedef = jax.tree_util.tree_flatten_with_path(template)
    missing = [path_to_str(k) for k, _ in keypaths if _flat_name(k) not in flat]
    if missing:
        raise UsageError(f"the checkpoint lacks {len(missing)} arrays the model needs, e.g. {missing[:3]}; "
                         "was it saved from a different model?")

    def restored(keypath: Any, leaf: Any) -> Any:
        value = flat[_flat_name(keypath)]
        if _is_key(leaf):
            return jax.random.wrap_key_data(value, impl=jax.random.key_impl(jnp.zeros((), leaf.dtype)))
        return value

    return jax.tree_util.tree_unflatten(treedef, [restored(k, leaf) for k, leaf in keypaths])


TREE_KEYS = ("params", "rest", "opt_state", "step", "skipped")


def as_tree(state: Any) -> dict[str, Any]:
    """A ``TrainState`` as the tree a checkpoint holds."""
    return {key: getattr(state, key) for key in TREE_KEYS}


def _is_tree(saved: dict[str, Any]) -> bool:
    """Whether a checkpoint's saved arrays are the state tree (else the flat dict of older ones)."""
    return set(saved) == set(TREE_KEYS)


def _dotted(keypath: Any) -> str:
    """``params.hidden.kernel``: a leaf's path, without the ``value`` of its NNX Variable (an
    attribute in a live state, a key in a checkpoint's metadata)."""
    name = _flat_name(keypath)
    return name.removesuffix(".value") if len(keypath) > 1 else name


def _named(tree: Any) -> dict[str, Any]:
    """A tree's leaves (arrays or their metadata) by dotted name, as older checkpoints named them."""
    def is_leaf(leaf: Any) -> bool:  # an array, or the metadata orbax keeps of one
        return hasattr(leaf, "shape") and not isinstance(leaf, nnx.Variable)

    return {_dotted(keypath): leaf
            for keypath, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def _check_shapes(saved: dict[str, Any], target: dict[str, Any], directory: Path) -> None:
    """One line naming the first array whose saved shape is not the model's (a parameter first)."""
    for name, leaf in sorted(target.items(), key=lambda item: not item[0].startswith("params.")):
        old = saved.get(name)
        if _is_key(leaf):  # stored as its raw bits
            leaf = jax.eval_shape(jax.random.key_data, leaf)
        if old is not None and tuple(old.shape) != tuple(leaf.shape):
            raise UsageError(f"the checkpoint in {directory} holds a different model: {name} has shape "
                             f"{tuple(old.shape)} there but {tuple(leaf.shape)} here; resume with the model "
                             "it was saved from")


def _write_failure(error: BaseException) -> str | None:
    """The operating system's reason when ``error`` (or what it wraps) is a failed write, else ``None``."""
    while error is not None:
        if isinstance(error, OSError):
            return error.strerror or str(error)
        code = re.search(r"os_error_code='(\d+)'", str(error))
        if code:
            return os.strerror(int(code.group(1)))
        error = error.__cause__ or error.__context__
    return None


class _SealedPart:
    """A commit future: the handler's writes, then this process's part of the manifest hashed
    (in orbax's background writer thread, while training goes on)."""

    def __init__(self, futures: list[Any], checkpoint: Path) -> None:
        self.futures, self.checkpoint = futures, checkpoint

    def result(self, timeout: float | None = None) -> None:
        failed = None
        for future in self.futures:  # every one is waited for, so that no failure goes unretrieved
            try:
                future.result(timeout=timeout)
            except Exception as error:  # noqa: PERF203
                failed = failed or error
        if failed is not None:
            raise failed
        seal_part(self.checkpoint, jax.process_index())

    def cancel(self) -> None:
        for future in self.futures:
            getattr(future, "cancel", lambda: None)()


class _StateHandler(ocp.StandardCheckpointHandler):
    """orbax's handler for the arrays; each process hashes the files it wrote once they are written."""

    async def async_save(self, directory: Any, *args: Any, **kwargs: Any) -> list[Any]:
        futures = await super().async_save(directory, *args, **kwargs) or []
        return [_SealedPart(list(futures), Path(getattr(directory, "path", directory)).parent)]


@ocp.args.register_with_handler(_StateHandler, for_save=True)
class SaveState(ocp.args.StandardSave):
    """orbax's ``StandardSave``, for the handler that hashes what it wrote."""


@ocp.args.register_with_handler(_StateHandler, for_restore=True)
class _RestoreState(ocp.args.StandardRestore):
    """orbax's ``StandardRestore``, for the same handler."""


def _first_over_processes(first: int) -> int:
    """The first bad unit any process found (-1: none), on every process (all of them call this)."""
    if jax.process_count() == 1:
        return first
    from jax.experimental import multihost_utils

    found = [int(v) for v in np.ravel(multihost_utils.process_allgather(np.int32(first))) if v >= 0]
    return min(found) if found else -1


class Checkpointer:
    """Save (asynchronously, sealed on commit) and restore by step, keeping the latest ``keep``."""

    def __init__(self, directory: str | Path, *, keep: int = 3) -> None:
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise UsageError(f"checkpoint directory {self.directory} is a file; give a directory")
        if keep < 1:
            raise UsageError(f"keep={keep}: keep at least 1 checkpoint")
        self._saving: int | None = None
        self.lock = DirectoryLock(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=False, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal_committing))
        handlers = {"state": _StateHandler(), "record": ocp.JsonCheckpointHandler()}
        try:  # a Grain iterator's position, one file per process
            import grain

            handlers["data"] = grain.checkpoint.CheckpointHandler()
        except ImportError:
            pass
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except OSError as error:
            raise UsageError(f"checkpoint directory {self.directory} cannot be created ({error.strerror}); "
                             "give a directory you can write to") from None

    def make_writable(self) -> None:
        """Create the directory, check that files can be written there and take its lock (before
        training starts): one run writes a checkpoint directory at a time."""
        probe = self.directory / f".shardax-write-test-{jax.process_index()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"checkpoint directory {self.directory} cannot be created ({error.strerror}); "
                             "give a directory you can write to") from None
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise UsageError(f"checkpoint directory {self.directory} is not writable ({error.strerror}); "
                             "give a directory you can write to") from None
        self.hold()

    def hold(self) -> None:
        """Take the directory's lock for this run (``shardax.trainer.lock``); a live holder is refused."""
        self.lock.acquire()

    def _seal_committing(self) -> None:
        """orbax's commit step (primary process, all processes' files written and their parts of the
        manifest hashed): merge the parts, hash what they leave out, seal before the rename."""
        for directory in self.directory.glob("*.orbax-checkpoint-tmp*"):
            if directory.is_dir():
                seal(directory, jax.process_index())

    def refuse_fresh_start(self, where: str, resume: str) -> None:
        """A run that does not resume may not write over checkpoints: one line naming ``where``
        they are and how to ``resume`` that run (said in the caller's words)."""
        step = self.latest_step()
        if step is not None:
            raise UsageError(f"{where} already holds checkpoints (latest step {step}); pass {resume} to "
                             "continue that run, or choose another directory")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_good_step(self) -> tuple[int, dict[int, str]]:
        """The newest checkpoint whose files match their seal, and what is wrong with each newer one
        (each process hashes an equal share of a checkpoint's blocks; all of them call this)."""
        damaged = {}
        share = (jax.process_index(), jax.process_count())
        # a step folder orbax does not list (its metadata gone) is a damaged step all the same
        folders = {int(p.name) for p in self.directory.glob("*") if p.name.isdigit() and p.is_dir()}
        for step in sorted(set(self.all_steps()) | folders, reverse=True):
            problem = damage(self.directory / str(step), share, agree=_first_over_processes)
            if problem is None:
                return step, damaged
            damaged[step] = problem
        if not damaged:
            raise UsageError(f"resume: no checkpoint in {self.directory}; start without resuming to create "
                             "one")
        raise UsageError(f"no good checkpoint in {self.directory}: "
                         + "; ".join(f"step {step} is damaged ({problem})"
                                     for step, problem in damaged.items())
                         + "; nothing was loaded: start a new run in another checkpoint directory")

    def set_aside(self, steps: list[int]) -> None:
        """Rename damaged checkpoints to ``<step>.damaged`` (kept for inspection, no longer steps)."""
        for step in steps:
            source = self.directory / str(step)
            target = self.directory / f"{step}.damaged"
            while target.exists():
                target = target.with_name(target.name + "~")
            if jax.process_index() == 0:
                try:
                    source.rename(target)
                except OSError as error:
                    raise UsageError(f"checkpoint of step {step} in {self.directory} is damaged and cannot "
                                     f"be set aside as {target.name} ({error.strerror}); resume from a "
                                     "writable copy of the directory, or remove that step yourself") from None
        if jax.process_count() > 1:  # every process sees the renames before it reads the steps again
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("shardax: damaged checkpoints set aside")
        self.manager.reload()

    def save(self, step: int, state: Any, record: dict[str, Any], data: Any = None) -> None:
        """Start saving ``state`` at ``step``; returns while the arrays are written in the background.

        ``data``: extra orbax args for the data position (a Grain iterator's state), saved now.
        """
        self.hold()
        if self._saving is not None:  # a failure of the write still under way is that step's, said as such
            with self._writing(self._saving):
                self.manager.wait_until_finished()
        items = {"state": SaveState(as_tree(state)), "record": ocp.args.JsonSave(record)}
        if data is not None:
            items["data"] = data
        with self._writing(step):
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._saving = step

    @contextlib.contextmanager
    def _writing(self, step: int | None) -> Iterator[None]:
        """A failed write (disk full, permission denied) as one line; the checkpoints already there stay."""
        try:
            yield
        except Exception as error:  # orbax and tensorstore wrap the OS error of their writer threads
            reason = _write_failure(error)
            if reason is None:
                raise
            with contextlib.suppress(Exception):
                self.manager.close()  # let its writer threads finish now rather than at interpreter exit
            step = self._saving if step is None else step
            what = "a checkpoint" if step is None else f"the checkpoint of step {step}"
            raise UsageError(f"could not write {what} to {self.directory} ({reason}); the checkpoints "
                             f"already there are intact (steps {self.all_steps()}); free space or choose "
                             "another checkpoint directory") from None

    def restore(self, step: int, abstract_state: Any, shardings: Any,
                data: Any = None) -> tuple[Any, dict[str, Any]]:
        """The state at ``step`` laid out by ``shardings`` (any strategy/mesh), and its record.

        ``data``: orbax restore args for the data position (restores a Grain iterator in place)."""
        target = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract_state, shardings,
        )
        saved = self.saved_arrays(step)
        tree = _is_tree(saved)
        wanted = as_tree(target) if tree else flatten_state(target)
        _check_shapes(_named(saved) if tree else saved, _named(wanted) if tree else wanted, self.directory)
        items = {"state": _RestoreState(wanted), "record": ocp.args.JsonRestore()}
        if data is not None:
            items["data"] = data
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        state = target.replace(**restored["state"]) if tree else unflatten_state(target, restored["state"])
        return state, dict(restored["record"])

    def saved_arrays(self, step: int) -> dict[str, Any]:
        """The saved arrays of ``step``: their metadata (``.shape``, ``.dtype``) in the saved tree
        (a flat dict for checkpoints of the older layout); nothing is read."""
        metadata = self.manager.item_metadata(step)["state"]
        return dict(getattr(metadata, "tree", metadata))

    def arrays(self, step: int) -> dict[str, Any]:
        """The saved arrays of ``step`` by dotted name (``params.hidden.kernel``, ``step``), on this
        process's first device, RNG keys as their raw bits (for inspection). Works whatever
        topology wrote the checkpoint (a target layout is built from its metadata)."""
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
                              self.saved_arrays(step),  # metadata
                              is_leaf=lambda leaf: hasattr(leaf, "shape"))
        restored = self.manager.restore(step, args=ocp.args.Composite(state=_RestoreState(target)))
        return {name: jax.random.key_data(leaf) if _is_key(leaf) else leaf
                for name, leaf in _named(restored["state"]).items()}

    def record(self, step: int) -> dict[str, Any]:
        return dict(self.manager.restore(step,
                                         args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"])

    def wait(self) -> None:
        with self._writing(None):
            self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            with self._writing(None):
                self.manager.wait_until_finished()
            self.manager.close()
        finally:
            self.lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def saved_steps(directory: str | Path) -> list[int]:
    """The steps of the checkpoints in ``directory`` (opened and closed again: for inspection)."""
    with Checkpointer(directory) as checkpointer:
        return checkpointer.all_steps()


def saved_arrays(directory: str | Path, step: int) -> dict[str, Any]:
    """The arrays saved at ``step``, as numpy arrays by flat name (for inspection and tests)."""
    import numpy as np

    with Checkpointer(directory) as checkpointer:
        return {name: np.asarray(value) for name, value in checkpointer.arrays(step).items()}
