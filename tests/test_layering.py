"""The package reads bottom-up: nothing imports a layer above its own.

    errors, vocabulary, mesh,     the usage error; the names users give; devices and processes;
    distributed, launch,          a plug-in named module:name
    cpu_devices, plugins
    sharding                      rules, strategies, layouts, placement, report
    runtime                       what runs inside a step: the pipeline, context attention
    layers, blocks, adapters,     what users and we train (blocks: LayerStack, Attention; any model's LoRA
    experts, decoding,            adapters; what a mixture of experts and a model generate() decodes expose),
    models, data                  shardax's own LM, the LM's data
    step                          the compiled train/eval step of any model under any layout
    model_parallel, model_state,  parallelize(), reshard(), a model's state; named parts of a run
    part_use, parts, compat       (and what each computes, read off the step); artifex's data-parallel API
    hf, generation                Hugging Face checkpoints in and out, into and from shards; generate()
    trainer                       the loop for any model: data sources, eval, metrics, checkpoints
    lm, analysis                  the LM job (a client of the trainer); plan, lint, audits
    cli                           the command lines
"""

import ast
from pathlib import Path

import shardax

LAYERS = [
    {"errors", "vocabulary", "mesh", "distributed", "launch", "cpu_devices", "plugins"},
    {"sharding"},
    {"runtime"},
    {"layers", "blocks", "adapters", "experts", "decoding", "models", "data"},
    {"step"},
    {"model_parallel", "model_state", "part_use", "parts", "compat"},
    {"hf", "generation"},
    {"trainer"},
    {"lm", "analysis"},
    {"cli"},
]
PACKAGE = Path(shardax.__file__).parent


def layer_of(top: str) -> int:
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"shardax.{top} is in no layer; add it to LAYERS (and to the docstring)")


def shardax_imports(path: Path) -> set[str]:
    """The first component under ``shardax`` of every module ``path`` imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardax."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("shardax.")}
    return found


def test_every_module_imports_only_its_own_layer_or_below():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue  # the public API gathers from every layer
        own = layer_of(parts[0])
        for imported in shardax_imports(path):
            if layer_of(imported) > own:
                upward.append(f"{'/'.join(parts)} ({parts[0]}) imports shardax.{imported}")
    assert not upward, upward


# work for any model, so import nothing of shardax's own LM (models/), its job (lm/) or its checkpoints (hf/)
GENERIC = {"model_parallel", "generation", "parts", "step", "trainer"}
LANGUAGE_MODEL = {"models", "lm", "hf"}
# left, for the trainer's owner: Trainer(init_from=<a checkpoint directory>) reads it by shardax.hf.factory
NOT_YET = {"trainer/models.py imports shardax.hf"}


def test_the_generic_layers_know_no_language_model():
    """parallelize, generate, parts, the step and the trainer know a language model only through
    protocols any model may follow (``shardax.experts.ExpertMixture``, ``shardax.decoding.CachedDecoder``)
    and what is plugged in from above; any model's LoRA adapters are ``shardax.adapters``."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] in GENERIC:
            found |= {f"{'/'.join(parts)}.py imports shardax.{name}"
                      for name in shardax_imports(path) & LANGUAGE_MODEL}
    assert found <= NOT_YET, sorted(found - NOT_YET)


def test_the_layer_list_covers_the_package():
    tops = {path.relative_to(PACKAGE).with_suffix("").parts[0]
            for path in PACKAGE.rglob("*.py")} - {"__init__"}
    assert tops == set().union(*LAYERS)


def test_nothing_imports_jax_private_modules():
    """JAX moves its private modules between releases (the GPU machines run another version than pip
    gives here); shardax uses only the public API."""
    private = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            private += [f"{path.relative_to(PACKAGE)}: {name}" for name in names
                        if name.startswith("jax._src")]
    assert not private, private


PROCESS_WIDE = {("os", "_exit"), ("threading", "excepthook"), ("sys", "unraisablehook"),
                ("sys", "excepthook"), ("warnings", "filterwarnings"), ("warnings", "simplefilter")}


def test_only_the_command_line_changes_process_wide_state():
    """Ending the process, exception hooks, warning filters and logger levels belong to the
    program that owns the process: the command line may set them, the library never does."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in PROCESS_WIDE:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "setLevel":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} setLevel")
    assert found == []


def test_every_module_is_one_topic():
    """No module over 400 lines. (A function's size is ruff's to check, in CI: at most 50
    statements and a complexity of 12, pyproject.toml's [tool.ruff.lint].)"""
    long = [f"{path.relative_to(PACKAGE)}: {len(path.read_text().splitlines())} lines"
            for path in sorted(PACKAGE.rglob("*.py")) if len(path.read_text().splitlines()) > 400]
    assert not long, long


def test_no_private_name_crosses_a_module_boundary():
    """A helper another module needs is public in its own module: no ``from shardax.x import _y``
    in the package, its tests, benchmarks or examples (nor of their own helper modules)."""
    root = PACKAGE.parents[1]
    files = [path for folder in ("src", "tests", "benchmarks", "examples")
             for path in (root / folder).rglob("*.py")]
    ours = {"shardax"} | {path.stem for path in files} | {path.parent.name for path in files}
    crossing = []
    for path in sorted(files):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ours:
                crossing += [f"{path.relative_to(root)}: {node.module}.{alias.name}" for alias in node.names
                             if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not crossing, crossing


def test_every_class_name_is_used_once_in_the_package():
    """One name, one thing: two classes called ``Run`` (or ``Trainer``) in two modules make a
    reader, a traceback and a search ask which one is meant."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}
