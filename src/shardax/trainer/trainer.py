"""``Trainer``: train any Flax NNX model with any optax optimizer, strategy and mesh.

    trainer = Trainer(lambda rngs: MyModel(rngs=rngs), optax.adamw(1e-3), loss_fn, strategy="fsdp")
    result = trainer.fit(train_batches, steps=1000, eval_data=held_out, eval_every=100,
                         checkpoint_dir="runs/a/ckpt", checkpoint_every=200, metrics="runs/a/metrics.jsonl")

    trainer = Trainer(parts={"generator": Part(G, optax.adam(2e-4)),
                             "discriminator": Part(D, optax.adam(2e-4))},
                      step=gan_step, strategy="fsdp")   # several models, the user's own step

``loss_fn(model, batch)`` returns the mean loss, or ``(loss, {"accuracy": ..., ...})``. The
Trainer owns the rest of a run: batches placed on the mesh, the compiled step, progress,
metrics (JSON lines, a PNG, optionally TensorBoard), evaluation in eval mode, asynchronous
checkpoints that resume exactly (parameters, optimizer, model state, RNG streams, data
position) and a summary. ``shardax train`` is one client of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from shardax.cpu_devices import describe_devices
from shardax.errors import UsageError
from shardax.mesh import describe_mesh
from shardax.model_parallel import LONE, ModelFactory, ParallelModel
from shardax.parts import ParallelParts, ParallelRun, Part
from shardax.sharding.place import abstract_batch, place_batch
from shardax.sharding.report import report
from shardax.sharding.strategies import Strategy
from shardax.step.loss import WEIGHT, LossFn
from shardax.step.parts import StepFn
from shardax.step.settings import StepSettings
from shardax.step.state import TrainState
from shardax.trainer.display import count_parameters
from shardax.trainer.models import first_weights, model_factory
from shardax.trainer.preemption import StopSignals
from shardax.trainer.procedure import check_procedure
from shardax.trainer.run import FitResult, FitRun, batch_rows, host_float
from shardax.trainer.samples import SampleFn, check_samples
from shardax.trainer.settings import FitSettings, TrainerSettings, settings_given
from shardax.trainer.sources import batch_source, evaluation_batches
from shardax.trainer.trackers import parse_tracker
from shardax.vocabulary import CONTEXT


class Trainer:
    """Train ``model`` (a factory ``rngs -> nnx.Module``) with ``optimizer`` on ``mesh`` by ``strategy``.

    Args:
      model: ``lambda rngs: MyModel(..., rngs=rngs)``; called abstractly to lay the model out, then
        once more to initialise it straight into its shards.
      optimizer: any ``optax.GradientTransformation``.
      loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, {"name": scalar})``, means over the batch.
        A mean over a varying count (tokens that are not padding) reports it as ``"weight"``:
        gradient accumulation and evaluation then weight by it (the same update as one batch).
        The model is in training mode (``model.train()``); what it updates in ``__call__``
        (BatchNorm statistics, Dropout's RNG counters, your own Variables) is kept.
      parts, step, eval_fn: instead of ``model``, ``optimizer`` and ``loss_fn``, a run of several
        models: ``parts={"generator": Part(make_g, optax.adam(2e-4)), "teacher": Part(make_t)}``
        (``shardax.Part``: each with its own optimizer, or frozen), and ``step(parts, batch) ->
        {"name": scalar}``, the user's step, which updates each trained part with
        ``parts.update(name, nnx.grad(loss)(parts[name]))`` (``shardax.step.parts``);
        ``eval_fn(parts, batch) -> {"name": scalar}`` is what evaluation computes.
      mesh: a ``jax.sharding.Mesh``, a shape such as ``"data=4,model=2"``, or ``None`` (every
        device on ``data``, plus what the strategy needs).
      strategy: ``dp``, ``zero1``, ``zero2``, ``fsdp``, ``tp``, ``fsdp_tp``, ``hsdp``, ``pp``,
        ``pp_fsdp``, ``pp_tp`` or a ``Strategy``.
      grad_accum: microbatches per step (the same update with less activation memory).
      microbatches, pipeline_repeats: under a pipeline strategy (``pp``, ``pp_fsdp``, ``pp_tp``),
        how many microbatches flow through the stages (default: one per stage) and how many
        times round (a circular schedule).
      context_attention: on a mesh with a ``context`` axis (sequences split over it), how
        attention reaches the other shares: ``all-gather`` (default) or ``ring``.
      seed: the model's initialisation (its ``nnx.Rngs``).
      eval_loss_fn: what evaluation computes, in eval mode; defaults to ``loss_fn``.
      learning_rate: the optimizer's schedule (or constant), only to log ``lr``.
      name: the title of what is printed (``shardax train`` for the LM).
      axis_names: for a model annotated with mesh axis names of its own (``("fsdp", "tp")`` on its
        weights, ``P("fsdp", None, "tp")`` on activations), which shardax mesh axis each name
        plays: ``{"fsdp": "data", "tp": "model"}`` or ``"fsdp=data,tp=model"`` (a YAML mapping
        works too). The model then runs on the mesh under its own names.
      example_batch: one batch (or its ``jax.ShapeDtypeStruct``s of the global batch). The steps
        are traced on it here, so that what the first step would refuse is refused before
        anything runs or is written (``check_step``); and under ``tp``, ``fsdp_tp`` and ``pp_tp``
        the weights without logical names are split as Megatron would, read off what ``loss_fn``
        computes on it (see ``parallelize``).
      init_from: a Hugging Face checkpoint directory of the Llama family (``shardax.hf``), or
        any object with ``initial_state(parallel, seed) -> TrainState`` (``shardax.hf.factory(path)``
        makes one that is also the checkpoint's model factory): the
        model starts from its weights, each device's slice read straight from the files,
        instead of from ``seed``. ``model`` may then be ``None`` (the checkpoint's own model,
        ``shardax.hf.factory(init_from)``); a model of another config is refused in one line.
      lora: ``shardax.LoRA(rank, alpha, targets)``: fine-tune with LoRA adapters, the base
        weights frozen (no gradient, no optimizer state). On a ``TransformerLM`` (shardax's, or a
        Hugging Face checkpoint's) ``targets`` names its projections (``"q,v"``), and the
        adapters are split like the weights they adapt; on any other model ``targets`` is a
        regular expression (or several) over layer paths, default every ``nnx.Linear``,
        ``nnx.LinearGeneral``, ``nnx.Einsum`` and ``nnx.Conv`` (``shardax.models.adapters``).
        Any model holding Flax's ``nnx.LoRAParam`` trains those alone anyway.
      trackers: where each ``fit`` also logs its records, on process 0: ``"tensorboard:DIR"``,
        ``"mlflow:DIR"`` (a local MLflow file store), ``"wandb:DIR"`` (W&B in offline mode), or
        objects with ``write(record)`` and ``close()``; see ``shardax.trainer.trackers``.
      settings: everything from ``mesh`` to ``trackers`` as one ``shardax.TrainerSettings``
        instead of keywords (a run's layout kept in one object, as ``fit`` takes a
        ``FitSettings``); the two together are refused, and so is a keyword that is none of them.
    """

    def __init__(self, model: ModelFactory | None = None,
                 optimizer: optax.GradientTransformation | None = None, loss_fn: LossFn | None = None, *,
                 eval_loss_fn: LossFn | None = None, parts: Mapping[str, Part] | None = None,
                 step: StepFn | None = None, eval_fn: StepFn | None = None,
                 settings: TrainerSettings | None = None, **options: Any) -> None:
        given = settings_given(settings, options, TrainerSettings, "Trainer()")
        self.trainer_settings = given
        for tracker in given.trackers:
            parse_tracker(tracker)  # a bad one refused now, before any work; each fit opens them
        self.trackers = list(given.trackers)
        self.settings = StepSettings.resolve(given.strategy, given.mesh, grad_accum=given.grad_accum,
                                             microbatches=given.microbatches,
                                             pipeline_repeats=given.pipeline_repeats,
                                             context_attention=given.context_attention)
        self.init_from = given.init_from
        self.weights = first_weights(given.init_from)
        self.parts = check_procedure(model, optimizer, loss_fn, parts, step, eval_fn, eval_loss_fn,
                                     given.init_from, given.lora, given.grad_accum)
        # one interface from here on (shardax.parts.ParallelRun): a lone model is the part "model"
        # whose step is its loss, gradient and update
        self.parallel: ParallelRun
        if self.parts is not None:
            self.parallel = ParallelParts.create(self.parts, self.settings, axis_names=given.axis_names,
                                                 example_batch=given.example_batch, step=step)
            self._train_fn, self._eval_fn = step, eval_fn
        else:
            self.parallel = ParallelModel.create(model_factory(model, self.weights, given.lora), optimizer,
                                                 self.settings, axis_names=given.axis_names, loss_fn=loss_fn,
                                                 example_batch=given.example_batch)
            self._train_fn, self._eval_fn = loss_fn, eval_loss_fn or loss_fn
        self.schedule = self.parallel.schedule()  # checked here, at the start
        self.context_attention = self.parallel.context_attention()  # None: no context axis
        self.loss_fn = loss_fn
        self.seed, self.name, self.learning_rate = given.seed, given.name, given.learning_rate
        self._state: TrainState | None = None
        self._run: FitRun | None = None  # the fit under way: its state is the trainer's
        self._steps: dict[str, Callable] = {}
        self.checked = False  # whether the train step was traced on a batch's shapes (check_step)
        if given.example_batch is not None:
            self.check_step(given.example_batch)

    def check_step(self, example_batch: Any) -> None:
        """Trace the train and eval steps on ``example_batch``'s shapes (no compile, no FLOP), so
        that whatever the first step would refuse (a batch that does not split, a sequence that
        does not cut into a context axis's chunks, a model a pipeline cannot stage) is refused now,
        before a run writes anything."""
        leaves = [leaf for leaf in jax.tree.leaves(example_batch) if np.ndim(leaf)]
        if leaves and (jax.process_count() == 1 or isinstance(leaves[0], jax.ShapeDtypeStruct)):
            self.settings.check_batch(np.shape(leaves[0])[0])  # the global batch: said in its own words
        batch = abstract_batch(example_batch, self.parallel.layout.batch())
        self.settings.check_batch(batch_rows(batch))
        # eval batches may hold more keys
        jax.eval_shape(self.train_step(), self.parallel.abstract_state, batch)
        self.checked = True

    @property
    def state(self) -> TrainState | None:
        """The latest state: a fit's as it trains (after each step), else the last one set."""
        return self._run.state if self._run is not None else self._state

    @state.setter
    def state(self, state: TrainState | None) -> None:
        self._state = state

    @property
    def mesh(self) -> Mesh:
        return self.parallel.mesh

    @property
    def strategy(self) -> Strategy:
        return self.parallel.strategy

    def init(self) -> TrainState:
        """A fresh state from ``seed`` (or the weights of ``init_from``), initialised straight
        into shards (also ``self.state``)."""
        if self.weights is not None:
            self.state = self.weights.initial_state(self.parallel, self.seed)
        else:
            self.state = self.parallel.init(seed=self.seed)
        return self.state

    def train_step(self, on_nonfinite: str = "stop") -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
        """The compiled ``(state, placed batch) -> (state, metrics)`` that ``fit`` calls."""
        if on_nonfinite not in self._steps:
            self._steps[on_nonfinite] = self.parallel.train_step(self._train_fn, nonfinite=on_nonfinite)
        return self._steps[on_nonfinite]

    def eval_step(self) -> Callable[[TrainState, Any], dict]:
        if "eval" not in self._steps:
            if self._eval_fn is None:
                raise UsageError("this run of parts has no evaluation step; give Trainer(eval_fn=lambda "
                                 "parts, batch: {'name': scalar, ...}) to evaluate, or leave eval_data out")
            self._steps["eval"] = self.parallel.eval_step(self._eval_fn)
        return self._steps["eval"]

    def place(self, batch: Any) -> Any:
        """A batch (this process's rows, or global arrays) as global arrays split over the batch axes."""
        return place_batch(batch, self.parallel.layout.batch())

    def evaluate(self, data: Any, state: TrainState | None = None, *, ema: bool = False) -> dict[str, float]:
        """Metrics of ``data`` (an iterable of batches) in eval mode, averaged over its rows (over
        the weight its loss reports, when it reports one: see ``shardax.step.loss``); with
        ``ema=True``, of the moving average of the weights (``shardax.ema_params``).

        Nothing changes: not the state, not the RNG streams, not the batch statistics.
        """
        state = state if state is not None else self.state if self.state is not None else self.init()
        state = self.parallel.ema_state(state) if ema else state
        totals: dict[str, float] = {}
        rows, weight = 0, 0.0
        for batch in evaluation_batches(data)():
            placed = self.place(batch)
            metrics = dict(self.eval_step()(state, placed))
            count = batch_rows(placed)
            # a loss that reports its weight (tokens that count) is averaged by it, else by rows
            batch_weight = host_float(metrics.pop(WEIGHT)) if WEIGHT in metrics else float(count)
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + host_float(value) * batch_weight
            rows, weight = rows + count, weight + batch_weight
        if not rows:
            raise UsageError("eval_data gave no batches; give at least one batch to evaluate on")
        return {name: total / weight if weight else 0.0 for name, total in totals.items()}

    def model(self, state: TrainState | None = None, *, ema: bool = False) -> nnx.Module:
        """The trained model as an ``nnx.Module`` in eval mode (its arrays stay sharded, in
        Variables of its own: what it changes never reaches the run); with ``ema=True``, holding
        the moving average of its weights (``shardax.ema_params``)."""
        names = self.parallel.names
        if len(names) > 1:
            raise UsageError(f"this trainer holds parts ({', '.join(names)}); take one with "
                             f"trainer.part({names[0]!r})")
        return self.part(names[0], state, ema=ema)

    def part(self, name: str, state: TrainState | None = None, *, ema: bool = False) -> nnx.Module:
        """Part ``name`` as an ``nnx.Module`` in eval mode (its arrays stay sharded, in Variables
        of its own); with ``ema=True``, holding the moving average of its weights when it keeps
        one. A lone model is the part named ``model``."""
        state = state if state is not None else self.state if self.state is not None else self.init()
        if ema and name in self.parallel.names and name not in self.parallel.averaged_parts(state):
            raise UsageError(f"part {name!r} keeps no moving average of its weights; chain "
                             "shardax.ema_params(decay) last in its optimizer, or take it with ema=False")
        return self.parallel.view(state, name, ema=ema)

    def for_sampling(self, state: TrainState | None = None) -> Any:
        """What to draw samples from: the model in eval mode with the moving average of its weights
        when its optimizer keeps one (``shardax.ema_params``), else its weights; in a run of parts,
        each part so, by name."""
        state = state if state is not None else self.state
        averaged = self.parallel.averaged_parts(state)
        views = {name: self.part(name, state, ema=name in averaged) for name in self.parallel.names}
        return views if self.parts is not None else views[LONE]

    def _check_hooks(self, samples: Any, settings: FitSettings) -> None:
        """``fit``'s samples hook and ``eval_ema``, refused in one line before the run if they cannot work."""
        check_samples(samples, settings.sample_every, settings.samples_dir, settings.samples_path)
        if settings.eval_ema and not self.parallel.averaged_parts(self.parallel.abstract_state):
            raise UsageError("eval_ema=True evaluates the moving average of the weights, and the optimizer "
                             "keeps none; chain shardax.ema_params(decay) last in it, or drop eval_ema")

    def _models(self) -> str:
        """What is trained: the model's class, or each part's name and class."""
        classes, frozen = self.parallel.classes(), self.parallel.frozen()
        if self.parts is None:
            return classes[LONE]
        return ", ".join(f"{name} ({cls}{', frozen' if name in frozen else ''})"
                         for name, cls in classes.items())

    def title(self) -> str:
        """One line naming the run for plots: name, model, size, strategy, mesh."""
        parameters = sum(int(np.prod(leaf.shape))
                         for leaf in jax.tree.leaves(self.parallel.abstract_state.params))
        model = self._models()
        return (f"{self.name}: {model} of {count_parameters(parameters)} parameters, {self.strategy.name} on "
                f"mesh {describe_mesh(self.mesh)} ({self.mesh.devices.size} {jax.devices()[0].platform} "
                "devices)")

    def describe(self) -> list[str]:
        """The lines printed at the start of ``fit``: model size, strategy, mesh, state per device."""
        parameters = sum(int(np.prod(leaf.shape))
                         for leaf in jax.tree.leaves(self.parallel.abstract_state.params))
        lines = [
            f"[bold]{self.name}[/bold]: {count_parameters(parameters)} parameters, strategy "
            f"[bold]{self.strategy.name}[/bold] ({self.strategy.description}) on mesh "
            f"{describe_mesh(self.mesh)} ({describe_devices(self.mesh)})",
            f"state: {report(self.parallel).summary()}",
        ]
        if self.parts is not None:
            lines.append(f"parts: {self._models()}")
        if self.schedule is not None:
            schedule = self.schedule
            repeats = f" x {schedule.repeats} repeats" if schedule.repeats > 1 else ""
            lines.append(f"pipeline: {schedule.stages} stages x {schedule.microbatches} "
                         f"microbatches{repeats}: {schedule.iterations} stage iterations per step, bubble "
                         f"{100 * schedule.bubble:.1f}%")
        if self.context_attention is not None:
            shards = self.mesh.shape[CONTEXT]
            how = ("keys and values all-gathered" if self.context_attention == "all-gather"
                   else "keys and values passed round a ring")
            # a loss marked sequence_order="zig-zag" (shardax's LM losses) feeds the model its tokens so;
            # another loss feeds them in order, and each device holds one contiguous share
            order = (f"zig-zag order ({2 * shards} chunks, each device two)"
                     if getattr(self.loss_fn, "sequence_order", None) == "zig-zag"
                     else "in order (one contiguous share each)")
            lines.append(f"context: each sequence split {shards} ways over context, {order}, {how}")
        layouts = self.parallel.layouts()
        fallbacks = [f"{part}{leaf.path}: {'; '.join(leaf.notes)}" for part, layout in layouts.items()
                     for leaf in layout.leaves.values() if leaf.notes]
        tensor = self.strategy.tensor_axis(self.mesh)
        whole = [f"  whole on {tensor}: {', '.join(part + path for path in paths)}: {reason}"
                 for part, layout in layouts.items()
                 for reason, paths in layout.whole_on_tensor_axis().items()]
        return lines + [f"  replicated or moved: {note}" for note in fallbacks[:5]] + whole

    def fit(self, data: Any, *, steps: int | None = None, eval_data: Any = None,
            samples: SampleFn | None = None, on_log: Callable[[dict[str, Any]], None] | None = None,
            header: Sequence[str] = (), settings: FitSettings | None = None, **options: Any) -> FitResult:
        """Train on ``data`` until step ``steps`` (or until the data runs out when ``steps`` is None).

        Args:
          data: batches as an iterable (list, generator, loader), a Grain dataset/DataLoader (its
            iterator state is checkpointed), or a function ``step -> batch``. With several
            processes each gives its own rows of every batch. See ``shardax.trainer.sources``.
          eval_data: held-out batches (a list, a Grain dataset, or a function returning an
            iterable), evaluated every ``eval_every`` steps (0: only at the end) and at the end.
          on_log: called with each record (every process, the same record).
          header: extra lines printed after the set-up lines.
          samples: ``draw(model, step) -> images`` in [0, 1], called every ``sample_every`` steps
            and at the end with a copy of the model in eval mode (its moving average when kept; in
            a run of parts a dict of them: drawing never changes the run), written as PNG grids
            into ``samples_dir`` (default ``run_dir/samples``) and to the trackers
            (``shardax.trainer.samples``).
          settings, options: the run's ``FitSettings`` (``run_dir``, ``eval_every``, ``log_every``,
            ``checkpoint_dir``, ``checkpoint_every``, ``resume``, ``metrics``, ...), each described
            there and checked before anything runs or is written: as one object,
            ``settings=FitSettings(...)``, or as keywords (then ``steps`` too), not both.

        SIGTERM or SIGINT (on any process) stops the run after the current step, with a
        checkpoint of it, by raising ``Preempted``: a ``SystemExit`` with code 75.
        """
        settings = settings_given(settings, {**({} if steps is None else {"steps": steps}), **options})
        self._check_hooks(samples, settings)
        source = batch_source(data)
        evaluations = evaluation_batches(eval_data) if eval_data is not None else None
        if not self.checked and (example := source.first_batch()) is not None:
            self.check_step(example)  # what the first step would refuse, refused before anything is written
        with StopSignals() as stops:  # from here to the final checkpoint: stop after a step, saved
            run = self._run = FitRun.start(self, source, settings, samples)
            try:
                run.display.print(*self.describe(), *header, *run.notes)
                return run.loop(evaluations, on_log, stops)
            finally:
                self._run, self.state = None, run.state
                run.close()
