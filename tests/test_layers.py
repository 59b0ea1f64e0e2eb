"""The layers of sdtk's first-party code, checked from the source (issue 23 item 2).

Every first-party module (library/, networks/, tools/, benchmarks/, finetune/ and the entry scripts; tests/
excluded) is parsed, every import of a first-party module is an edge (top-level and
function-local alike; ``from pkg import mod`` is an edge to ``pkg.mod`` when ``mod`` is a module),
and:

(a) every edge points to the module's own layer or a lower one (``LAYERS``, bottom -> top);
(b) the module graph has no cycle, and neither has the graph of packages (``package_of``: no two
    packages import each other, even where the modules' graph has no cycle);
(c) no first-party import sits inside a function, except in the ``LAZY_MODULES`` below (each
    with its reason), and there each such import carries a ``# lazy:`` comment; at most
    ``MAX_LAZY_IMPORTS`` such import statements in all (the others sit at the module top);
(d) no first-party module is imported under another name (``import library.x as y``,
    ``from library.x import mod as y``): a reader sees which module is called.
(e) no stdlib import sits inside a function without a ``# lazy:`` comment (they belong at the top);
(f) every function-local third-party import carries a ``# lazy:`` comment: a light path (--help,
    the dry run's plan, the UI server's start) loads its module before torch, it is an optional
    dependency, or it would slow a run that does not use it (``unmarked_local_imports``).

The order, and why it is this one:

0. ``library`` itself, ``library.errors`` (the user-error base, and the errors lower layers raise
   and the entry glue answers: ``DataError``, ``ModelError``, ``ResumeError``, ``NonFiniteStop``,
   ``TrainingInterrupted``), ``library.log``, ``library.files`` (atomic writes, stale
   temporaries, output names), ``library.safetensors_file`` (reproducible safetensors
   headers), ``library.text_files`` (UTF-8 text a user writes) and
   ``library.symlinks``: used by every layer, importing nothing of ours but each other.
1. ``library.config``: what the user writes (the schema, the run and dataset configs, which
   script trains which method). Below data and models: the dataset config owns
   ``CaptionOptions`` (a subset's caption settings), which data's caption processing reads.
2. ``library.models``: loading, families, formats, dtypes (``compute_dtype`` and
   ``trained_precision`` are dtype decisions: placement), modelspec names.
3. ``library.data``: images to micro-batches, the caches, the held-out split (``held_out``),
   a latent-cache entry's slot (``latent_cache.latent_slot``); beside it ``library.dataset_tools``
   (caption edits, metadata JSON, folder preparation, the dataset check: the data layer's image
   and caption readers, for the tools and the UI above).
4. ``networks``: LoRA networks and the LoRA tools (they read models, never training).
5. ``library.accelerator``: the process group's primitives (the one "main process?" answer,
   the Accelerator, the bucketed gradient sum, loss sums). It sits below training, and
   ``library.distributed`` above it: the steppers in training sum through these primitives and
   every layer asks ``is_main_process()``, while the strategies choose and build the stepper
   (and its optimizer, for DeepSpeed) and so use training. It is not in the ``distributed``
   package, so that training and distributed do not import each other (rule (b)).
6. ``library.training``: the loop's parts (methods, losses, optimizers, steppers, EMA, guards,
   validation, samples, the progress record, the stop signals and control commands).
7. ``library.distributed``: the strategies (single process, DDP, FSDP, DeepSpeed), which also
   name the folder their part of a training state lives in.
8. ``library.outputs``: what a run writes (model saves and states: ``checkpoints``,
   ``train_state``; metadata, trackers, output checks, the progress stream).
9. ``library.run``: the run's orchestration (the stages, the loop, the run's parts, the checks
   before loading, LECO's run), the one package that uses both training and outputs.
10. ``library.cli``, ``tools``, ``benchmarks``, ``finetune``: entry glue and scripts over the library.
11. ``library.ui``: the web UI, which starts runs through the entry glue.
12. The entry scripts (``train_lora.py``, ``ui.py``, ...).
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("library", "networks", "tools", "benchmarks", "finetune")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("library", "library.errors", "library.log", "library.files", "library.safetensors_file",
     "library.text_files", "library.symlinks"),
    ("library.config",),
    ("library.models",),
    ("library.data", "library.dataset_tools"),
    ("networks",),
    ("library.accelerator",),
    ("library.training",),
    ("library.distributed",),
    ("library.outputs",),
    ("library.run",),
    ("library.cli", "tools", "benchmarks", "finetune"),
    ("library.ui",),
    (),  # the entry scripts: every top-level module
)

# At most this many function-local first-party import statements in all (issue 38 item 5).
MAX_LAZY_IMPORTS = 20

# The modules that may import first-party modules inside a function, and why: each is where a
# light path (--help, the options, the plan, the UI server) meets modules that import torch at
# their top. Every such import carries a "# lazy:" comment (on its line or above its block).
LAZY_MODULES: dict[str, str] = {
    "library.cli": "--help and option errors must not import torch: the run is imported once the "
                   "options are parsed",
    "library.run.trainer": "a dry run prints its plan, and the checks before loading run, before "
                           "torch is imported (tests/config/test_bad_input.py); then it imports the "
                           "stages (library/run/stages.py), and a resume's check the state module",
    "library.run.stages": "the dry run's memory estimate imports fake tensors and bitsandbytes' "
                          "optimizer types, which a training run does not need",
    "library.data.training_data": "the training set and the step plan are built without torch; "
                                  "image loading and textual inversion's tokens import it when used",
    "library.outputs.output_checks": "the output name and path checks run before the plan is "
                                     "printed, without torch; the free-space estimate imports the "
                                     "memory estimate when used",
    "library.distributed.deepspeed_zero": "an Accelerate DeepSpeed launch is folded into the "
                                          "options before the plan, without torch; its stepper "
                                          "imports the optimizer when built",
    "library.training.progress": "a run holds its progress record from the start, before torch is "
                                 "imported; reading scale_weight_norms' statistics needs the "
                                 "network module (torch) only when a state is written",
    "library.ui.app": "the UI server starts without torch: a form's check loads the run's checks "
                      "when asked",
    "benchmarks.sd_scripts_launch": "run as a script it is in sd-scripts' process, where our "
                                    "library package would stand for sd-scripts' own: its helpers "
                                    "for our side import it when called",
    "tools.merge_sd3_safetensors": "its --help must not wait for diffusers and transformers (about "
                                   "5 s): the merge imports them once the options are parsed",
    "tools.convert_diffusers20_original_sd": "its --help must not wait for torch, diffusers and "
                                             "transformers: the conversion imports them once the "
                                             "options are parsed",
    "tools.merge_models": "its --help must not wait for torch: the merge imports it once the options "
                          "are parsed",
    "library.ui.jobs": "the UI server starts without torch: a resumed job's command looks for "
                       "states when built",
}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    local: bool      # inside a function
    alias: str | None  # the other name a module was imported under
    commented: bool = False  # a "# lazy:" comment on its line or above its block of imports


def _module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def find_modules(root: str, packages=PACKAGES) -> dict[str, str]:
    """Module name -> path: the packages' .py files and the top-level scripts."""
    out = {}
    for pkg in packages:
        for folder, dirs, files in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in files:
                if f.endswith(".py"):
                    out[_module_name(root, os.path.join(folder, f))] = os.path.join(folder, f)
    for f in os.listdir(root):
        if f.endswith(".py") and os.path.isfile(os.path.join(root, f)):
            out[f[:-3]] = os.path.join(root, f)
    return out


def import_edges(root: str, packages=PACKAGES) -> tuple[dict[str, str], list[Edge]]:
    """Every first-party import of every first-party module, as edges."""
    modules = find_modules(root, packages)
    first = set(packages) | {m for m in modules if "." not in m}
    edges = []
    for name, path in sorted(modules.items()):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text, path)
        lines = text.splitlines()

        def commented(lineno: int) -> bool:
            return _lazy_commented(lines, lineno)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]

        def visit(node, local):
            for child in ast.iter_child_nodes(node):
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.Import):
                    for a in child.names:
                        if a.name.split(".")[0] in first:
                            edges.append(Edge(name, a.name, child.lineno, local, a.asname,
                                              local and commented(child.lineno)))
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package.split(".")[: len(package.split(".")) - child.level + 1]
                        mod = ".".join(base + ([child.module] if child.module else []))
                    else:
                        mod = child.module
                    if mod.split(".")[0] in first:
                        for a in child.names:
                            full = f"{mod}.{a.name}"
                            is_mod = full in modules
                            edges.append(Edge(name, full if is_mod else mod, child.lineno, local,
                                              a.asname if is_mod else None,
                                              local and commented(child.lineno)))
                visit(child, inner)

        visit(tree, False)
    return modules, edges


def layer_of(module: str, layers=LAYERS) -> int:
    """The layer of the longest prefix naming ``module`` or a package above it; a top-level
    module of no package is an entry script (the last layer)."""
    best, depth = len(layers) - 1, -1
    for i, names in enumerate(layers):
        for n in names:
            if (module == n or module.startswith(n + ".")) and n.count(".") > depth:
                best, depth = i, n.count(".")
    return best


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.src != e.dst:
            graph.setdefault(e.src, set()).add(e.dst)
            graph.setdefault(e.dst, set())
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def package_of(module: str) -> str:
    """The package a module belongs to for the package graph: ``library.<name>`` (a sub-package,
    or a module directly in library/), the top package of networks/, tools/, ... , or the entry
    script itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "library" else parts[0]


def package_cycles(edges: list[Edge]) -> list[list[str]]:
    """The cycles of the package graph (``package_of`` of each edge's ends)."""
    return cycles([Edge(package_of(e.src), package_of(e.dst), e.line, e.local, e.alias)
                   for e in edges])


def lazy_imports(edges: list[Edge]) -> list[tuple[str, int]]:
    """(module, line) of every function-local first-party import statement."""
    return sorted({(e.src, e.line) for e in edges if e.local})


def violations(edges: list[Edge], layers=LAYERS, lazy=LAZY_MODULES,
               max_lazy=MAX_LAZY_IMPORTS) -> dict[str, list]:
    """``local``: function-local first-party imports outside the ``lazy`` modules, or without
    their "# lazy:" comment; ``too_many_lazy``: all of them, when there are more than
    ``max_lazy``."""
    up = sorted({(e.src, e.dst, e.line) for e in edges
                 if layer_of(e.dst, layers) > layer_of(e.src, layers)})
    local = sorted({(e.src, e.dst, e.line) for e in edges
                    if e.local and (e.src not in lazy or not e.commented)})
    aliases = sorted({(e.src, e.dst, e.alias) for e in edges if e.alias})
    statements = lazy_imports(edges)
    return {"upward": up, "cycles": cycles(edges), "package_cycles": package_cycles(edges),
            "local": local, "too_many_lazy": statements if len(statements) > max_lazy else [],
            "aliases": aliases}


def test_layers_cycles_local_imports_and_aliases():
    modules, edges = import_edges(ROOT)
    pairs = {(e.src, e.dst) for e in edges if e.src != e.dst}
    # not vacuous: the scan sees the whole code base and its imports
    assert len(modules) >= 120, len(modules)
    assert len(pairs) >= 350, len(pairs)
    assert {"library.run.trainer", "library.cli", "networks.lora", "tools.cache_latents",
            "train_lora"} <= set(modules)
    assert ("library.run.stages", "library.distributed.strategy") in pairs
    found = violations(edges)
    assert found == {"upward": [], "cycles": [], "package_cycles": [], "local": [],
                     "too_many_lazy": [], "aliases": []}
    assert 0 < len(lazy_imports(edges)) <= MAX_LAZY_IMPORTS
    # every module allowed lazy imports still has some (remove it here when they go)
    assert set(LAZY_MODULES) == {e.src for e in edges if e.local}


def _write(root, rel: str, text: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def test_checker_finds_a_planted_upward_import_cycle_local_import_and_alias(tmp_path):
    """A tiny tree with one of each fault: the checker reports exactly those."""
    root = str(tmp_path)
    for pkg in ("library", "library/config", "library/models", "library/training"):
        _write(root, f"{pkg}/__init__.py", "")
    _write(root, "library/errors.py", "class UserError(Exception):\n    pass\n")
    # upward: config (layer 1) imports training (layer 6)
    _write(root, "library/config/options.py",
           "from library.errors import UserError\nfrom library.training import loop\n")
    _write(root, "library/training/loop.py", "from library.models import loading\n")
    # cycle inside models; one side hidden in a function (also the planted local import)
    _write(root, "library/models/loading.py", "from library.models import sd_checkpoint\n")
    _write(root, "library/models/sd_checkpoint.py",
           "def f():\n    from library.models import loading\n    return loading\n")
    # alias of a module
    _write(root, "library/models/family.py", "from library.models import loading as models\n")
    _write(root, "train.py", "from library.config import options\n")
    # an allowed lazy module: its commented import passes, the bare one does not
    _write(root, "library/training/loop.py",
           "from library.models import loading\n\n\ndef f():\n"
           "    # lazy: the plan comes before torch\n    from library.models import family\n"
           "    return family\n\n\ndef g():\n    from library.models import sd_checkpoint\n"
           "    return sd_checkpoint\n")
    modules, edges = import_edges(root, ("library",))
    assert set(modules) == {"library", "library.config", "library.models", "library.training",
                            "library.errors", "library.config.options", "library.training.loop",
                            "library.models.loading", "library.models.sd_checkpoint",
                            "library.models.family", "train"}
    assert len(edges) == 9
    assert violations(edges, LAYERS, {"library.training.loop": "planted"}) == {
        "upward": [("library.config.options", "library.training.loop", 2)],
        "cycles": [["library.models.loading", "library.models.sd_checkpoint"]],
        "package_cycles": [],
        "local": [("library.models.sd_checkpoint", "library.models.loading", 2),
                  ("library.training.loop", "library.models.sd_checkpoint", 11)],
        "too_many_lazy": [],
        "aliases": [("library.models.family", "library.models.loading", "models")],
    }
    # the same tree without the faults is clean
    _write(root, "library/config/options.py", "from library.errors import UserError\n")
    _write(root, "library/models/sd_checkpoint.py", "def f():\n    return 1\n")
    _write(root, "library/models/family.py", "from library.models import loading\n")
    _write(root, "library/training/loop.py", "from library.models import loading\n")
    assert violations(import_edges(root, ("library",))[1], LAYERS, {}) == {
        "upward": [], "cycles": [], "package_cycles": [], "local": [], "too_many_lazy": [],
        "aliases": []}


def test_checker_finds_a_planted_package_pair_and_too_many_lazy_imports(tmp_path):
    """Two packages that import each other through modules that form no cycle, and which the
    layers allow (the layout before library/accelerator.py left library/distributed/): only the
    package check reports them. Then four commented lazy imports against limits of 4 and 3."""
    root = str(tmp_path)
    for pkg in ("library", "library/distributed", "library/training"):
        _write(root, f"{pkg}/__init__.py", "")
    _write(root, "library/distributed/accelerator.py", "MAIN = True\n")
    _write(root, "library/training/stepper.py", "from library.distributed.accelerator import MAIN\n")
    _write(root, "library/distributed/strategy.py", "from library.training import stepper\n")
    layers = LAYERS[:5] + (("library.distributed.accelerator",),) + LAYERS[6:]
    edges = import_edges(root, ("library",))[1]
    assert cycles(edges) == []
    assert violations(edges, layers, {}) == {
        "upward": [], "cycles": [], "package_cycles": [["library.distributed", "library.training"]],
        "local": [], "too_many_lazy": [], "aliases": []}
    # four lazy imports, each with its comment, in an allowed module: fine under 4, not under 3
    _write(root, "library/distributed/strategy.py",
           "def a():\n    # lazy: planted\n    from library.training import stepper\n"
           "    return stepper\n\n\ndef b():\n"
           "    from library.training import stepper  # lazy: planted\n    return stepper\n\n\n"
           "def c():\n    # lazy: planted\n    from library.training import stepper\n"
           "    from library.distributed import accelerator\n    return stepper, accelerator\n")
    _write(root, "library/training/stepper.py", "MAIN = True\n")
    edges = import_edges(root, ("library",))[1]
    allowed = {"library.distributed.strategy": "planted"}
    assert lazy_imports(edges) == [("library.distributed.strategy", 3),
                                   ("library.distributed.strategy", 8),
                                   ("library.distributed.strategy", 14),
                                   ("library.distributed.strategy", 15)]
    assert violations(edges, LAYERS, allowed, max_lazy=4) == {
        "upward": [], "cycles": [], "package_cycles": [], "local": [], "too_many_lazy": [],
        "aliases": []}
    assert violations(edges, LAYERS, allowed, max_lazy=3)["too_many_lazy"] == lazy_imports(edges)


def test_layer_of_takes_the_longest_prefix():
    assert layer_of("library.accelerator") < layer_of("library.training.stepper")
    assert layer_of("library.training.stepper") < layer_of("library.distributed.strategy")
    assert layer_of("library.errors") == 0 and layer_of("library") == 0
    assert layer_of("train_lora") == len(LAYERS) - 1
    assert layer_of("library.run.trainer") < layer_of("library.cli") < layer_of("library.ui.app")


# -- (e), (f): function-local imports of other code ------------------------------------------------
# A stdlib or third-party import inside a function carries a "# lazy: <reason>" comment (on its line
# or above its block of imports), as first-party ones do: stdlib imports belong at the module top
# (they are cheap), and a heavy third-party import stays in a function only where a light path
# (--help, the dry run's plan, the UI server's start) loads the module before torch, where it is an
# optional dependency, or where it would slow a run that does not use it (measured: the light paths
# at run time, the start-up cost of an import against a 1-step LoRA run); the others sit at the top.


def _lazy_commented(lines: list[str], lineno: int) -> bool:
    """A "# lazy:" comment on the statement's line or above it in its block of imports (comments,
    blank lines and import statements up to the previous other line)."""
    i = lineno - 1
    if "# lazy:" in lines[i]:
        return True
    while i > 0:
        i -= 1
        s = lines[i].strip()
        if "# lazy:" in s:
            return True
        if s and not s.startswith(("#", "import ", "from ")):
            return False
    return False


def unmarked_local_imports(root: str, packages=PACKAGES) -> dict[str, list]:
    """``stdlib`` / ``third_party``: (module, imported module, line) of each function-local import
    of that kind without a "# lazy:" comment (first-party ones are the edges' rule (c))."""
    import sys

    modules = find_modules(root, packages)
    first = set(packages) | {m for m in modules if "." not in m}
    out: dict[str, list] = {"stdlib": [], "third_party": []}
    for name, path in sorted(modules.items()):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()

        def visit(node, local):
            for child in ast.iter_child_nodes(node):
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if local and isinstance(child, (ast.Import, ast.ImportFrom)) and not (
                        isinstance(child, ast.ImportFrom) and child.level):
                    mod = child.names[0].name if isinstance(child, ast.Import) else child.module
                    top = mod.split(".")[0]
                    if top not in first and top != "__future__" \
                            and not _lazy_commented(lines, child.lineno):
                        kind = "stdlib" if top in sys.stdlib_module_names else "third_party"
                        out[kind].append((name, mod, child.lineno))
                visit(child, inner)

        visit(ast.parse(text, path), False)
    return out


def test_function_local_stdlib_and_third_party_imports_carry_a_lazy_comment():
    found = unmarked_local_imports(ROOT)
    assert found == {"stdlib": [], "third_party": []}


def test_checker_finds_planted_unmarked_stdlib_and_third_party_local_imports(tmp_path):
    root = str(tmp_path)
    _write(root, "library/__init__.py", "")
    _write(root, "library/a.py",
           "import os\nimport torch\n\n\ndef f():\n    import json\n    import numpy as np\n"
           "    from torch import nn\n    return json, np, nn, os, torch\n\n\n"
           "def g():\n    # lazy: optional dependency (wandb), imported when log_with asks for it\n"
           "    import wandb\n    import re  # lazy: planted, on the line\n    return wandb, re\n\n\n"
           "class C:\n    import math\n\n    def h(self):\n        from library import a\n"
           "        from . import a as b\n        return a, b, (lambda: __import__('csv'))\n")
    assert unmarked_local_imports(root, ("library",)) == {
        "stdlib": [("library.a", "json", 6)],
        "third_party": [("library.a", "numpy", 7), ("library.a", "torch", 8)]}
    # the same tree with the comments is clean
    _write(root, "library/a.py",
           "def f():\n    # lazy: planted\n    import json\n    import numpy as np\n\n"
           "    from torch import nn\n    return json, np, nn\n")
    assert unmarked_local_imports(root, ("library",)) == {"stdlib": [], "third_party": []}
