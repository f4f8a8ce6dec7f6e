"""The package's import graph keeps its layers: every import points down, none forms a cycle, and
no module imports another module's private (``_``) names.

Layers, lowest first (a module may import its own layer's lower sub-layers and anything below):
layout < mesh < spec < planning < kernels < collectives < runtime < ops < tensor < nn < tools.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "axedist"

# (layer rank, module prefix): the longest matching prefix decides a module's layer
LAYERS = [
    (0, "axedist.layout"),
    (0, "axedist.env"),  # the AXEDIST_* variables, parsed and checked once (no torch)
    (0, "axedist.caches"),  # the registry of every memo: axedist.reset() clears them all
    (0, "axedist.tracing"),  # torch.compile facts and metadata work outside a trace: torch only
    (0, "axedist.placements"),  # torch's placement classes, re-exported
    (1, "axedist.mesh"),
    (1, "axedist.peers"),  # agreement checks and who did not arrive: the job's store, no mesh
    (1, "axedist.topology"),  # hosts and links: pure records the mesh builds and planning reads
    (2, "axedist.spec"),
    (3, "axedist.planning"),
    (3, "axedist.layout_inference"),  # the front door of planning, by the design's name
    (4, "axedist.kernels"),
    (5, "axedist.collectives"),
    (6, "axedist.runtime"),
    (7, "axedist.ops"),
    (8, "axedist.autograd"),
    (9, "axedist.dtensor"),
    (10, "axedist.nn"),
    (11, "axedist.visualize"),
    (11, "axedist.testing"),
]
EXEMPT = {"axedist"}  # the package's own __init__: the public API, loaded lazily


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int | None:
    best = None
    for rank, prefix in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[1]):
                best = (rank, prefix)
    return None if best is None else best[0]


def imports(path: Path, here: str | None = None):
    """``(line, imported module, imported names)`` of every axedist import, function bodies included."""
    tree = ast.parse(path.read_text())
    here = here or module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("axedist"):
                    yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("axedist"):
                names = tuple(a.name for a in node.names)
                # "from . import x" imports the submodule x
                if node.module is None:
                    for name in names:
                        yield node.lineno, f"{target}.{name}", ()
                else:
                    yield node.lineno, target, names


MODULES = sorted(PACKAGE.rglob("*.py"))
# tests and benchmarks: held to "no private names of the package" (they may import any layer)
USERS = sorted(p for folder in ("tests", "tests_multigpu", "tests_onegpu", "benchmarks", "launch")
               for p in (PACKAGE.parent / folder).glob("*.py"))


def private_uses(path: Path, here: str):
    """Private names of other axedist modules this file reaches: ``from m import _x``, and
    ``alias._x`` where ``alias`` names an axedist module."""
    tree = ast.parse(path.read_text())
    for line, target, names in imports(path, here):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private and target != here:
            yield f"line {line}: imports private {private} from {target}"
    modules = _module_aliases(tree, path, here)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and node.value.id in modules:
            yield f"line {node.lineno}: uses private {node.value.id}.{node.attr}"


def _module_aliases(tree, path, here):
    """Local names bound to axedist modules other than this one (``import axedist.x as y``,
    ``from axedist import x`` where x is a module)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("axedist") and a.name != here:
                    out.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = here if path.name == "__init__.py" else here.rpartition(".")[0]
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if not base.startswith("axedist"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full != here and (PACKAGE.parent / (full.replace(".", "/") + ".py")).exists() or \
                        (PACKAGE.parent / full.replace(".", "/") / "__init__.py").exists():
                    out.add(a.asname or a.name)
    return out


def test_every_module_has_a_layer():
    missing = [module_name(p) for p in MODULES if module_name(p) not in EXEMPT and layer(module_name(p)) is None]
    assert not missing, f"modules outside every layer: {missing}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_down_and_no_private_names(path):
    here = module_name(path)
    if here in EXEMPT:
        return
    mine = layer(here)
    problems = []
    for line, target, names in imports(path):
        theirs = layer(target)
        if theirs is not None and theirs > mine:
            problems.append(f"line {line}: {here} (layer {mine}) imports {target} (layer {theirs}): upward")
    problems += list(private_uses(path, here))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", USERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_tests_and_benchmarks_use_no_private_names(path):
    problems = list(private_uses(path, f"{path.parent.name}.{path.stem}"))
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    graph = {}
    for path in MODULES:
        here = module_name(path)
        graph[here] = {t for _, t, _ in imports(path) if t != here}
    # resolve "from package import name" to the module when name is one
    known = set(graph)
    for here, targets in graph.items():
        graph[here] = {t for t in targets if t in known}
    seen, stack, cycles = {}, [], []

    def visit(node):
        seen[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if nxt in EXEMPT or node in EXEMPT:
                continue
            if seen.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = "done"

    for node in sorted(graph):
        if node not in seen:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def _module_bindings(path: Path, here: str) -> dict[str, str]:
    """``{local name: axedist module}`` for names this file binds to axedist modules, function
    bodies included (``from ..kernels import ag_gemm``, ``import axedist.mesh as m``)."""
    tree = ast.parse(path.read_text())
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("axedist.") and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if (PACKAGE.parent / (full.replace(".", "/") + ".py")).exists():
                    out[a.asname or a.name] = full
    return out


@pytest.mark.parametrize("path", MODULES + USERS, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_module_attributes_exist(path):
    """``module.name`` for an axedist module bound in this file names something that module
    defines: code that runs only on GPUs (``ag_gemm.prepare_operands`` once lost its import) is
    checked here too."""
    import importlib

    here = module_name(path) if path.is_relative_to(PACKAGE) else f"{path.parent.name}.{path.stem}"
    bindings = _module_bindings(path, here)
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bindings \
                and isinstance(node.ctx, ast.Load):
            module = importlib.import_module(bindings[node.value.id])
            if not hasattr(module, node.attr):
                missing.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({bindings[node.value.id]} has no "
                               f"{node.attr!r})")
    for line, target, names in imports(path, here):  # "from m import name", function bodies included
        if not names or not (PACKAGE.parent / target.replace(".", "/")).with_suffix(".py").exists() and \
                not (PACKAGE.parent / target.replace(".", "/") / "__init__.py").exists():
            continue
        module = importlib.import_module(target)
        for name in names:
            if name != "*" and not hasattr(module, name) and \
                    not (PACKAGE.parent / f"{target.replace('.', '/')}/{name}.py").exists():
                missing.append(f"line {line}: from {target} import {name} ({target} has no {name!r})")
    assert not missing, "\n".join(missing)


# Module-level mutable containers that are state, not memos (reset() must not clear them), each
# with the reason; every other module-level dict/list/set is made through axedist.caches.
STATE = {
    "axedist.caches": {"_CLEARERS": "the registry itself"},
    "axedist.runtime.carriers": {"_WARM": "groups whose NCCL communicator was warmed by a barrier"},
    "axedist.runtime.deferred": {"_PLACEHOLDERS": "placeholders of deferred results, by storage",
                                 "PENDING": "deferred work not yet consumed, what it did, the gather policy"},
    "axedist.ops.fusion": {"PENDING_USERS": "the registry of ops that take deferred work as it stands"},
    "axedist.runtime.executor": {"_RECORDS": "the stack of open record() blocks"},
    "axedist.runtime.checks": {"PENDING": "value checks made and not yet settled (raised or passed)",
                               "_QUEUED_FOR": "the backward whose final callback settles them"},
    "axedist.ops.fastpath": {"_EMPTY": "an empty kwargs dict, never written"},
    "axedist.ops.state": {"RECORDING": "the stack of fast-path recorders"},
    "axedist.ops.registry": {"RULES": "the sharding rules' registry"},
    "axedist.nn.fsdp": {"_RUNNING": "the FSDP schedules of the running backward",
                        "_STEPS": "the count of FSDP steps begun (a gather by hand serves the next only)"},
    "axedist.collectives.symmetric": {"_workspaces": "symmetric memory, freed collectively (collectives.reset)",
                                      "_retired": "retired workspaces peers may still read"},
    "axedist.mesh": {"_GROUPS": "process groups, created collectively", "_GROUP_TOPOLOGY": "hosts found collectively",
                     "_FOUND": "topologies found collectively", "_WARNED": "warn-once state",
                     "_NUMBERED": "every live mesh by its number (weak): how a traced from_local names its mesh",
                     "_JOB_WORLD": "the world group (weak) the group tables were filled under"},
    "axedist.dtensor": {"_NODES": "the traced graph nodes of to_local / from_local"},
    "axedist.peers": {"_CHOSEN": "the timeout init_mesh was given", "_FAILURES": "failures this rank reported",
                      "_SEQUENCE": "agreement counters, in step on every rank",
                      "_READ": "the last agreement check each rank set's texts were read at (when a text may go)"},
    "axedist.testing.ranks": {"_POOLS": "running rank pools", "_FRESH": "the forkserver context"},
}
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary",
                  "WeakSet", "deque"}
_MUTATORS = {"append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "insert", "remove",
             "discard", "__setitem__"}


def _written(tree: ast.Module) -> set[str]:
    """Names the module writes into (``x[k] = v``, ``x.append(...)``, ``del x[k]``, ...) anywhere."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and isinstance(node.value, ast.Name):
            names.add(node.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name):
            names.add(node.func.value.id)
    return names


def _module_level_memos(tree: ast.Module):
    """Module-level mutable containers the module writes into, and module-level lru_cache uses."""
    written = _written(tree)
    registered = {ast.unparse(node.value.args[1]).removesuffix(".clear") for node in tree.body
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                  and ast.unparse(node.value.func).endswith("register") and len(node.value.args) == 2}
    written -= registered  # caches.register(name, X.clear): registered by hand
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if value is not None:
            call = value.func.attr if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) else (
                value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None)
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) \
                    or call in _MUTABLE_CALLS:
                for target in targets:
                    if isinstance(target, ast.Name) and target.id in written:
                        yield "container", target.id, node.lineno
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for decorator in node.decorator_list:
                text = ast.unparse(decorator)
                if "lru_cache" in text or text in ("functools.cache", "cache"):
                    yield "lru_cache", node.name, node.lineno


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_memos_are_registered(path):
    """No module-level memo outside the registry that axedist.reset() clears (axedist/caches.py):
    lru_caches are ``caches.cached``, dict caches ``caches.memo``; what stays is named state."""
    here = module_name(path)
    allowed = STATE.get(here, {})
    bad = [f"line {line}: {kind} {name}" for kind, name, line in _module_level_memos(ast.parse(path.read_text()))
           if not (kind == "container" and name in allowed)]
    assert not bad, f"{here}: module-level memos outside axedist.caches (make them caches.cached / caches.memo, " \
                    f"or name them as state in STATE with the reason): {bad}"


# Tables that outlive a call (module-level, or an attribute) keyed by ``id(...)`` of an object,
# each with why the id cannot go stale: a freed object's id is reused, so an entry that does not
# keep its object alive is served to whatever object gets the id next (a descriptor cache keyed by
# id(workspace) once was). Key by the object itself, or keep it in the entry and name the table here.
ID_KEYED = {
    "axedist.runtime.executor": {"_AGREED_ROUTES": "the entry is the route", "_STAYS": "the entry is the spec",
                                 "_PROGRAMS": "the entry holds its plan, and the lookup checks it is this plan"},
    "axedist.mesh": {"_GROUP_TOPOLOGY": "the entry holds its group, and the lookup checks it is this group"},
    "axedist.dtensor": {"_AGREED_LOCALS": "the entry is the mesh"},
    "axedist.nn.fsdp": {"parametrize._cache": "torch's parametrize cache, keyed as torch keys it; emptied when "
                                              "parametrize.cached() exits, while the modules live"},
}
_KEYED_METHODS = {"get", "setdefault", "pop", "add", "discard", "remove"}


def _calls_id(node, id_names: set) -> bool:
    """Whether ``node`` holds a call of the builtin ``id``, or a local name bound to one."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "id"
               or isinstance(n, ast.Name) and n.id in id_names for n in ast.walk(node))


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_nodes(scope):
    """The nodes of ``scope`` outside the functions nested in it (comprehensions included)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _id_keyed_tables(scope, enclosing: frozenset = frozenset()):
    """``(line, table)`` for each use of a table that outlives the call (a module-level name or an
    attribute: ``_seen``, ``self._flat``) with a key that calls ``id``: ``t[id(x)]``, ``t.get(key)``
    after ``key = (id(x), n)``, ``id(x) in t``, ``t.add(id(x))``, ``t = {id(x): x}``. Tables local
    to one call (a function's own, or its enclosing function's: their objects live through it)
    are left alone."""
    nodes = list(_own_nodes(scope))
    local = set(enclosing)
    if isinstance(scope, _SCOPES):
        local |= {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
        local |= {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        local -= {name for n in nodes if isinstance(n, ast.Global) for name in n.names}
    id_names = {t.id for n in nodes if isinstance(n, ast.Assign) and _calls_id(n.value, set())
                for t in n.targets if isinstance(t, ast.Name)}
    for node in nodes:
        table = None
        if isinstance(node, ast.Subscript) and _calls_id(node.slice, id_names):
            table = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _KEYED_METHODS and node.args and _calls_id(node.args[0], id_names):
            table = node.func.value
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _calls_id(node.left, id_names):
            table = node.comparators[0]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Dict, ast.DictComp)):
            keys = node.value.keys if isinstance(node.value, ast.Dict) else [node.value.key]
            if any(k is not None and _calls_id(k, id_names) for k in keys):
                table = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if isinstance(table, ast.Attribute) or isinstance(table, ast.Name) and table.id not in local:
            yield node.lineno, ast.unparse(table)
        if isinstance(node, _SCOPES):
            yield from _id_keyed_tables(node, frozenset(local if isinstance(scope, _SCOPES) else ()))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_cache_is_keyed_by_id(path):
    """No table that outlives a call is keyed by ``id(...)`` unless ID_KEYED says why its ids stay
    their own objects'."""
    here = module_name(path)
    allowed = ID_KEYED.get(here, {})
    bad = sorted({f"line {line}: {table}" for line, table in _id_keyed_tables(ast.parse(path.read_text()))
                  if table not in allowed})
    assert not bad, f"{here}: tables keyed by id(...), which a freed object's successor reuses (key by the object, " \
                    f"or keep it in the entry and name the table in ID_KEYED with the reason): {bad}"


def test_the_id_key_rule_catches_a_stale_cache():
    """The rule fails on the bug it is for, in each spelling, and leaves a call's own tables alone."""
    bad = """
_descriptors = {}
class Launcher:
    def descriptor(self, workspace):
        key = (id(workspace), workspace.nbytes)
        if key not in _descriptors:
            _descriptors[key] = make(workspace)
        self._seen.add(id(workspace))
        return _descriptors.get(key)
_BY_ID = {id(x): 1 for x in ()}
"""
    found = sorted(set(_id_keyed_tables(ast.parse(bad))))
    assert found == [(6, "_descriptors"), (7, "_descriptors"), (8, "self._seen"), (9, "_descriptors"),
                     (10, "_BY_ID")], found
    fine = """
def replace(values, targets):
    local = {id(v): t for v, t in zip(values, targets)}
    return [local[id(v)] for v in values if id(v) in local]
"""
    assert list(_id_keyed_tables(ast.parse(fine))) == []


def test_reset_clears_every_registered_memo():
    """axedist.reset() empties the planning and spec memos and the dispatcher's caches."""
    import axedist
    from axedist import caches
    from axedist.dtensor import DTensor

    assert "ops.dispatcher of DTensor" in caches.names() and "axedist.spec._interned_spec" in caches.names()
    DTensor.dispatcher.cache.plans["probe"] = None
    DTensor.dispatcher.cache.torch_calls["probe"] = None
    axedist.reset()
    assert "probe" not in DTensor.dispatcher.cache.plans and "probe" not in DTensor.dispatcher.cache.torch_calls


def test_top_level_is_small_and_moved_names_warn():
    """The top level a user learns in one sitting (torch's names, the layout algebra, plan, the
    fused ops, the errors: at most 40); a name that moved to its subpackage still resolves,
    with a DeprecationWarning naming its home."""
    import warnings

    import axedist

    assert len(axedist.__all__) <= 40, sorted(axedist.__all__)
    for name in ("DTensor", "distribute_tensor", "Shard", "Layout", "plan", "gemm_reduce_scatter", "reset"):
        assert name in axedist.__all__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from axedist.testing import run_on_ranks
        assert axedist.run_on_ranks is run_on_ranks
    assert any(issubclass(w.category, DeprecationWarning) and "axedist.testing.run_on_ranks" in str(w.message)
               for w in caught)


def test_one_wrap_site():
    """A DTensor is made in one place, ``ops.state.wrap`` (the constructor, the dispatcher's
    routes and the fast path call it): ``_make_wrapper_subclass`` appears nowhere else but in the
    probe that decides how ``wrap`` passes its arguments."""
    calls = {}
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "_make_wrapper_subclass":
                calls.setdefault(module_name(path), []).append(node.lineno)
    assert set(calls) == {"axedist.ops.state"}, calls
    state = ast.parse((PACKAGE / "ops" / "state.py").read_text())
    users = {f.name for f in ast.walk(state) if isinstance(f, ast.FunctionDef)
             and any(isinstance(n, ast.Name) and n.id == "_make_wrapper" for n in ast.walk(f))}
    assert users == {"_wrap_positional", "_wrap_by_keyword"}, users
