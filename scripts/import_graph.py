"""The import graph of fsdp-ext, read from the source (AST), and the layering rules it must obey.

    python scripts/import_graph.py                 # rooms and their imports, as text
    python scripts/import_graph.py --dot out.dot   # every module, Graphviz DOT
    python scripts/import_graph.py --png docs/import_graph.png   # the rooms, drawn
    python scripts/import_graph.py --check         # exit 1 on a cycle, a layering break
                                                   # a private torch name or a read of FSDP's
                                                   # internal objects outside _torch.py,
                                                   # a checkpoint module's file I/O
                                                   # outside its storage (fs.py), or
                                                   # frame inspection in the library

Every ``import`` counts, function-local ones included, and importing ``a.b.c`` also
imports the packages ``a.b`` and ``a`` (their ``__init__`` runs first), as Python does.
The rules are those of docs/architecture.md; ``tests/test_architecture.py`` runs them.
"""

from __future__ import annotations

import argparse
import ast
import functools
import io
import re
import sys
import tokenize
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folders.
PACKAGES = ("fsdp_ext", "benchmarks", "examples")
# The kernels: a layer below the rest of the library, which they never import.
KERNELS = "fsdp_ext.kernels"
# Where private torch names are looked for (tests may reach into anything).
PRIVATE_SCAN = ("fsdp_ext", "benchmarks", "examples", "scripts")
TORCH_SHIMS = "fsdp_ext/_torch.py"

LIBRARY = "fsdp_ext"
# Shared pieces every room may import: the torch shims, the node size and the mesh description.
COMMON = ("fsdp_ext._torch", "fsdp_ext.node_size", "fsdp_ext.parallel_dims")
# Capability rooms: each imports another only through that room's ``__init__``.
ROOMS = ("wrap", "comm", "moe", "checkpoint", "job", "pipeline", "integrations", "lab", "testing")
# A room built on another's internals: ``job`` (a run's checkpoints over time) is the run
# level of ``checkpoint`` (DCP I/O) and may import its modules; the reverse never.
BUILT_ON = {"job": "checkpoint"}
# Rooms nothing else inside the library may import (they compose the library, or test it).
OUTER_ROOMS = ("integrations", "lab", "testing")
# Layers, outermost first: a module may import its own layer or one further down.
LAYERS = {"examples": 0, "benchmarks": 0, "fsdp_ext": 1, KERNELS: 2}

# Private torch attribute names: any ``x._name`` read in the shims is one, and these.
KNOWN_TORCH_PRIVATE = frozenset(
    {
        "_get_fsdp_state",
        "_fsdp_param_group",
        "_fsdp_param_groups",
        "_fsdp_params",
        "_orig_size",
        "_unsharded_param",
        "_local_tensor",
        "_orig_mod",
        "_run_policy",
        "_flatten",
        "_unflatten",
    }
)
# Attributes of FSDP2's internal objects (FSDPState, FSDPParamGroup, FSDPParam and their mesh
# info) that look public but move between releases (2.15 dropped ``FSDPParamGroup.mp_policy``):
# read only in the shims. Names public elsewhere in torch (``param_dtype`` of a
# MixedPrecisionPolicy, an optimizer's ``param_groups``) are left out: reads of those on an
# FSDP object are caught by where the object came from (``FSDP_OBJECT_SOURCES``).
FSDP_INTERNAL_ATTRS = frozenset(
    {
        "fsdp_params",
        "mp_policy",
        "comm_ctx",
        "param_group",
        "sharded_param",
        "padded_sharded_param_size",
        "sharded_size",
        "unsharded_accumulated_grad",
        "unsharded_grad_data",
        "all_gather_outputs",
        "mesh_info",
        "post_forward_mesh_info",
        "shard_process_group",
        "replicate_mesh_dim",
        "shard_mesh_size",
        "is_unsharded",
        "is_sharded_post_forward",
        "orig_dtype",
    }
)
# Shim functions that hand out FSDP's internal objects: any attribute read on what they return
# (a name bound to it, a loop over it, an element of it) is a read of FSDP internals. So is a
# read on a parameter annotated with one of ``FSDP_OBJECT_TYPES``.
FSDP_OBJECT_SOURCES = frozenset(
    {"param_group", "param_groups", "fsdp_params", "trainable_fsdp_params"}
)
# Internal attributes whose values are FSDP objects too (not a public ProcessGroup or policy).
FSDP_OBJECT_ATTRS = frozenset(
    {"fsdp_params", "param_group", "mesh_info", "post_forward_mesh_info", "comm_ctx"}
)
FSDP_OBJECT_TYPES = frozenset({"FSDPParamGroup", "FSDPParam", "FSDPState"})
# Private names of other libraries that an adapter overrides on purpose (not torch's).
FOREIGN_PRIVATE_OK = {
    "fsdp_ext/integrations/hf_trainer.py": {
        # transformers' Trainer: the only hooks that see the checkpoint dir on every rank
        "_save_optimizer_and_scheduler",
        "_load_optimizer_and_scheduler",
    },
    # NumPy's array pickles name numpy._core.multiarray._reconstruct: the safe-globals
    # allowlist for non-tensor items needs that object
    "fsdp_ext/checkpoint/unpickler.py": {"_core", "_reconstruct"},
    # os._exit: a torchrun worker whose group broke exits without Python's teardown (3 s)
    "examples/recovery.py": {"_exit"},
}
# Files outside the library that run PyTorch's own tests, which import its private testing
# package (torch.testing._internal); the file's reason is its docstring.
TORCH_TESTING_OK = {"scripts/dcp_upstream_tests.py"}
TORCH_PRIVATE_RE = re.compile(r"\btorch(?:\.[A-Za-z0-9_]+)*\._[A-Za-z0-9]")


@dataclass(frozen=True)
class Import:
    """One ``import`` statement's edge: ``source`` imports module ``target``."""

    source: str
    target: str
    names: tuple[str, ...]  # for ``from target import a, b``; () for ``import target``
    line: int
    local: bool  # inside a function body
    implicit: bool = False  # a package whose ``__init__`` runs because a submodule is imported


@dataclass
class Graph:
    root: Path = ROOT
    modules: dict[str, Path] = field(default_factory=dict)
    packages: set[str] = field(default_factory=set)
    exports: dict[str, set[str] | None] = field(default_factory=dict)  # __all__ per module
    imports: list[Import] = field(default_factory=list)

    def edges(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for imp in self.imports:
            out[imp.source].add(imp.target)
        return out


@functools.cache
def _parsed(path: str, mtime_ns: int, size: int) -> ast.Module:
    return ast.parse(Path(path).read_text(), filename=path)


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once per version of the file: every check reads the
    same few hundred files, and parsing them is most of a check's time. Trees are read only."""
    st = path.stat()
    return _parsed(str(path), st.st_mtime_ns, st.st_size)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _dunder_all(tree: ast.Module) -> set[str] | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = node.value
            if isinstance(value, ast.List | ast.Tuple):
                return {e.value for e in value.elts if isinstance(e, ast.Constant)}
    return None


def _walk_with_scope(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node, with whether it sits inside a function body."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, local = stack.pop()
        yield node, local
        inner = local or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = source.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def collect(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> Graph:
    """Every module of ``packages`` under ``root`` and every import among them."""
    graph = Graph(root)
    trees: dict[str, ast.Module] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            name = module_name(path, root)
            graph.modules[name] = path
            if path.name == "__init__.py":
                graph.packages.add(name)
            trees[name] = parse(path)
            graph.exports[name] = _dunder_all(trees[name])
    internal = set(graph.modules)
    for source, tree in trees.items():
        for node, local in _walk_with_scope(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    _add(graph, internal, source, alias.name, (), node.lineno, local)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(source, source in graph.packages, node)
                names = tuple(a.name for a in node.names)
                submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in internal]
                plain = tuple(n for n in names if f"{target}.{n}" not in internal)
                if plain or not submodules:
                    _add(graph, internal, source, target, plain, node.lineno, local)
                for sub in submodules:
                    _add(graph, internal, source, sub, (), node.lineno, local)
    return graph


def _add(
    graph: Graph, internal: set[str], source: str, target: str, names: tuple, line: int, local: bool
) -> None:
    if target not in internal:
        return
    graph.imports.append(Import(source, target, names, line, local))
    # Importing a.b.c runs a.b's and a's __init__ first, unless the importer is inside them.
    parts = target.split(".")
    for i in range(1, len(parts)):
        package = ".".join(parts[:i])
        if package in internal and not (source + ".").startswith(package + "."):
            graph.imports.append(Import(source, package, (), line, local, implicit=True))


# ------------------------------------------------------------------------------ rules


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-import)."""
    edges = graph.edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan, iterative over successors
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1 or node in edges.get(node, ()):
                        found.append(sorted(component))

    for v in sorted(graph.modules):
        if v not in index:
            visit(v)
    return found


def room_of(module: str) -> str | None:
    """``fsdp_ext.comm.register`` -> ``comm``; None for the top package and common modules."""
    parts = module.split(".")
    if parts[0] != LIBRARY or len(parts) < 2 or parts[1] not in ROOMS:
        return None
    return parts[1]


def layer_of(module: str) -> str:
    """The key of ``LAYERS`` a module sits in: its top package, or the kernels."""
    if module == KERNELS or module.startswith(KERNELS + "."):
        return KERNELS
    return module.split(".")[0]


def layering_violations(graph: Graph) -> list[str]:
    """Every import that breaks a rule of docs/architecture.md, one line each."""
    problems = []
    for imp in graph.imports:
        if imp.implicit:
            continue
        where = f"{graph.modules[imp.source].relative_to(graph.root).as_posix()}:{imp.line}"
        src_top, dst_top = layer_of(imp.source), layer_of(imp.target)
        if LAYERS[dst_top] < LAYERS[src_top]:
            problems.append(f"{where}: {imp.source} imports {imp.target} (an outer layer)")
            continue
        if src_top != LIBRARY or dst_top != LIBRARY:
            if src_top in ("benchmarks", "examples") and dst_top == LIBRARY:
                problems += _public_only(graph, imp, where)
            continue
        src_room, dst_room = room_of(imp.source), room_of(imp.target)
        if imp.target == LIBRARY:
            problems.append(f"{where}: {imp.source} imports the top package (it imports all)")
        elif dst_room in OUTER_ROOMS and src_room != dst_room:
            problems.append(
                f"{where}: {imp.source} imports fsdp_ext.{dst_room}, which nothing inside "
                "the library may import"
            )
        elif src_room is not None and BUILT_ON.get(dst_room or "") == src_room:
            problems.append(
                f"{where}: {imp.source} imports fsdp_ext.{dst_room}, which is built on "
                f"fsdp_ext.{src_room}: imports run one way"
            )
        elif dst_room is not None and src_room != dst_room != BUILT_ON.get(src_room or ""):
            problems += _public_only(graph, imp, where)
    return problems


def _public_only(graph: Graph, imp: Import, where: str) -> list[str]:
    """From outside a room (or the library): only a package's ``__all__`` names, or an
    adapter module of ``fsdp_ext.integrations``."""
    target = imp.target
    if target.startswith(f"{LIBRARY}.integrations.") and not target.rsplit(".", 1)[-1].startswith(
        "_"
    ):
        return []
    if target in COMMON and imp.source.startswith(f"{LIBRARY}."):
        return []
    if target not in graph.packages:
        return [f"{where}: {imp.source} imports {target}, a room's internals; use its package"]
    exported = graph.exports.get(target) or set()
    hidden = [n for n in imp.names if n not in exported]
    if not imp.names and target != LIBRARY:
        hidden = []  # ``import fsdp_ext.comm``: attribute use is then checked by __all__ alone
    return [f"{where}: {imp.source} imports {n!r} from {target}, not in __all__" for n in hidden]


def surface_problems(graph: Graph) -> list[str]:
    """The library's packages re-export one way: plain imports listed in ``__all__``."""
    problems = []
    for name in sorted(graph.packages):
        if layer_of(name) != LIBRARY:
            continue
        path = graph.modules[name]
        rel = path.relative_to(graph.root).as_posix()
        tree = parse(path)
        exported = graph.exports.get(name)
        if exported is None:
            problems.append(f"{rel}: no __all__ (every package lists its public names)")
            continue
        imported = set()
        # names a package loads on first use (PEP 562): imported under ``if TYPE_CHECKING:``
        # for readers and type checkers, and served by the package's ``__getattr__``
        lazy = {
            alias.asname or alias.name
            for node in tree.body
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
            for sub in node.body
            if isinstance(sub, ast.ImportFrom)
            for alias in sub.names
        }
        if lazy and not any(
            isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body
        ):
            problems.append(f"{rel}: imports {sorted(lazy)} under TYPE_CHECKING, no __getattr__")
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module not in ("__future__", "typing"):
                for alias in node.names:
                    if alias.asname is not None and alias.asname == alias.name:
                        problems.append(
                            f"{rel}:{node.lineno}: 'import {alias.name} as "
                            f"{alias.name}': list the name in __all__ instead"
                        )
                    imported.add(alias.asname or alias.name)
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)} | {
            t.id
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for missing in sorted(exported - imported - defined - lazy):
            problems.append(f"{rel}: __all__ lists {missing!r}, which it does not define")
        for unlisted in sorted(imported - exported):
            problems.append(f"{rel}: imports {unlisted!r} without listing it in __all__")
    return problems


# ------------------------------------------------------------------ private torch names


@dataclass(frozen=True)
class PrivateUse:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def _code_only(source: str) -> list[str]:
    """The source's lines with comments and strings blanked (docstrings may name anything)."""
    lines = source.splitlines()
    out = [list(line) for line in lines]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(
            tokenize, "FSTRING_MIDDLE", -1
        ):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = out[r - 1]
                start = c0 if r == r0 else 0
                stop = c1 if r == r1 else len(row)
                row[start:stop] = " " * (stop - start)
    return ["".join(row) for row in out]


def _defined_names(trees: Iterable[ast.Module]) -> set[str]:
    """Private names this code base defines itself (functions, classes, attributes it sets),
    minus methods that only override a parent's method of the same name."""
    defined: set[str] = set()
    overrides: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if _calls_super_same(node):
                    overrides.add(node.name)
                else:
                    defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("fsdp_ext", "benchmarks", "examples")
            ):
                defined.update(a.asname or a.name for a in node.names)
    return defined


def _calls_super_same(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    for inner in ast.walk(node):
        if (
            isinstance(inner, ast.Attribute)
            and inner.attr == node.name
            and isinstance(inner.value, ast.Call)
            and isinstance(inner.value.func, ast.Name)
            and inner.value.func.id == "super"
        ):
            return True
    return False


def _private_attrs(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) of every ``x._name`` read and ``getattr(x, "_name")`` style access."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = node.attr
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if name.startswith("_") and not name.startswith("__"):
                yield node.lineno, name
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            if name.startswith("_") and not name.startswith("__"):
                yield node.lineno, name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield node.lineno, f"{node.module}.{alias.name}"


def private_torch_uses(root: Path = ROOT, dirs: Iterable[str] = PRIVATE_SCAN) -> list[PrivateUse]:
    """Private torch names used outside ``fsdp_ext/_torch.py``: ``torch.x._y`` in code (not
    in strings or comments), an attribute the shims read privately, a known FSDP2/DTensor
    private attribute, or any ``x._name`` this code base does not define itself."""
    files = [p for d in dirs for p in sorted((root / d).rglob("*.py")) if ".venv" not in p.parts]
    sources = {p: p.read_text() for p in files}
    own_trees = [parse(p) for p in sources]
    own_trees += [parse(p) for p in sorted((root / "tests").glob("*.py"))]
    shim_tree = parse(root / TORCH_SHIMS)
    torch_private = KNOWN_TORCH_PRIVATE | {name for _, name in _private_attrs(shim_tree)}
    ours = _defined_names(own_trees) - torch_private
    found = []
    for path, source in sources.items():
        rel = path.relative_to(root).as_posix()
        if rel == TORCH_SHIMS:
            continue
        lines = source.splitlines()
        for number, code in enumerate(_code_only(source), 1):
            if rel in TORCH_TESTING_OK and "torch.testing._internal" in code:
                continue
            if TORCH_PRIVATE_RE.search(code):
                found.append(PrivateUse(rel, number, lines[number - 1].strip()))
        allowed = FOREIGN_PRIVATE_OK.get(rel, set())
        for number, name in _private_attrs(parse(path)):
            if name in allowed or (name in ours and "." not in name):
                continue
            kind = "import of private" if "." in name else "private attribute"
            found.append(PrivateUse(rel, number, f"{kind} {name}"))
    return sorted(set(found), key=lambda u: (u.path, u.line, u.text))


def _names_in(annotation: ast.AST) -> set[str]:
    """Every name an annotation mentions (``list[FSDPParamGroup] | None``, quoted or not)."""
    names = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return names


def _fsdp_object_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names in ``func`` bound to FSDP internal objects: assigned from a shim that returns
    them, a loop or comprehension over one, or a parameter annotated with an FSDP type."""
    tainted: set[str] = set()
    for arg in [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]:
        if arg.annotation is not None and _names_in(arg.annotation) & FSDP_OBJECT_TYPES:
            tainted.add(arg.arg)

    def is_fsdp(expr: ast.AST) -> bool:
        while isinstance(expr, ast.Subscript | ast.Starred):
            expr = expr.value
        if isinstance(expr, ast.Name):
            return expr.id in tainted
        if isinstance(expr, ast.Attribute):  # group.fsdp_params, already one read
            return expr.attr in FSDP_OBJECT_ATTRS
        if isinstance(expr, ast.Call):
            fn = expr.func
            name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            if name in FSDP_OBJECT_SOURCES:
                return True
            if name in ("list", "tuple", "enumerate", "reversed", "sorted", "iter") and expr.args:
                return is_fsdp(expr.args[0])
        return False

    def bind(target: ast.AST) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                tainted.add(node.id)

    changed = True
    while changed:  # to a fixed point: a name bound from a name bound from a shim
        before = len(tainted)
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and is_fsdp(node.value):
                for target in node.targets:
                    bind(target)
            elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
                if is_fsdp(node.value):
                    bind(node.target)
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension) and is_fsdp(
                node.iter
            ):
                bind(node.target)
        changed = len(tainted) != before
    tainted.discard("self")
    return tainted


def _fsdp_internal_reads(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, description) of every read of an FSDP internal object's attribute."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if node.attr in FSDP_INTERNAL_ATTRS:
                yield node.lineno, f"read of FSDP internal attribute .{node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in FSDP_INTERNAL_ATTRS
        ):
            yield node.lineno, f"read of FSDP internal attribute .{node.args[1].value}"
    for scope in ast.walk(tree):
        if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        names = _fsdp_object_names(scope)
        if not names:
            continue
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                owner = node.value
                while isinstance(owner, ast.Subscript):
                    owner = owner.value
                if isinstance(owner, ast.Name) and owner.id in names:
                    yield node.lineno, f"attribute .{node.attr} read on FSDP object {owner.id}"
            elif (  # getattr(group, "anything"): the same read, spelled differently
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in names
            ):
                yield (
                    node.lineno,
                    f"attribute read via {node.func.id} on FSDP object {node.args[0].id}",
                )


def fsdp_internal_reads(root: Path = ROOT, dirs: Iterable[str] = PRIVATE_SCAN) -> list[PrivateUse]:
    """Reads of FSDP2's internal objects outside ``fsdp_ext/_torch.py``: a known internal
    attribute (``.fsdp_params``, ``.mp_policy``, ``.mesh_info``, ...) on anything, and any
    attribute of an object a shim handed out (``param_groups(m)[0].device``)."""
    found = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == TORCH_SHIMS or ".venv" in path.parts:
                continue
            for line, text in _fsdp_internal_reads(parse(path)):
                found.append(PrivateUse(rel, line, text))
    return sorted(set(found), key=lambda u: (u.path, u.line, u.text))


# ------------------------------------------------------------------ frame inspection

# Reading the interpreter's stack frames (this thread's or another's): behaviour that depends
# on who called, or on what another thread is doing, instead of state passed explicitly.
FRAME_CALLS = frozenset(
    {
        "sys._current_frames", "sys._getframe", "sys._getframemodulename",
        "inspect.currentframe", "inspect.stack", "inspect.trace", "inspect.getouterframes",
        "inspect.getinnerframes", "traceback.extract_stack", "traceback.walk_stack",
        "traceback.format_stack", "traceback.print_stack",
    }
)  # fmt: skip
FRAME_ATTRS = frozenset({"f_back", "f_locals", "f_globals", "tb_frame"})
# "path::function" -> why it may, for now
FRAME_INSPECTION_OK = {
    "fsdp_ext/testing/gpu_counters.py::HostSyncs._record": (
        "a test counter's report of where a host sync came from; nothing depends on it"
    ),
}


def _frame_inspections(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """(line, enclosing function's qualified name, what) of every frame read."""
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, scope = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope = f"{scope}.{node.name}" if scope else node.name
        if isinstance(node, ast.Attribute) and _dotted(node) in FRAME_CALLS:
            yield node.lineno, scope, f"{_dotted(node)}"
        elif isinstance(node, ast.Attribute) and node.attr in FRAME_ATTRS:
            yield node.lineno, scope, f"frame attribute .{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "inspect", "traceback"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in FRAME_CALLS:
                    yield node.lineno, scope, f"from {node.module} import {alias.name}"
        stack.extend((child, scope) for child in ast.iter_child_nodes(node))


def frame_inspections(root: Path = ROOT) -> list[PrivateUse]:
    """Frame inspection in the library (``sys._getframe``, ``sys._current_frames``,
    ``inspect.stack``, ``inspect.currentframe``, ``traceback.extract_stack``, a frame's
    ``f_back``, ...), outside the functions of ``FRAME_INSPECTION_OK``."""
    found = []
    for path in sorted((root / LIBRARY).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for line, scope, text in _frame_inspections(parse(path)):
            if f"{rel}::{scope}" not in FRAME_INSPECTION_OK:
                found.append(
                    PrivateUse(rel, line, f"frame inspection: {text} in {scope or '<module>'}")
                )
    return sorted(set(found), key=lambda u: (u.path, u.line, u.text))


# ------------------------------------------------------------------ checkpoint storage

CHECKPOINT_ROOMS = ("fsdp_ext/checkpoint", "fsdp_ext/job")
# the checkpoint modules that may touch files, and why
STORAGE_IO_OK = {
    "fsdp_ext/checkpoint/fs.py": "the local storage implementation",
    "fsdp_ext/checkpoint/direct_file.py": "the local storage's data files, around the page cache",
    "fsdp_ext/checkpoint/blob_posix.py": "the blob primitives on a POSIX directory",
    "fsdp_ext/checkpoint/processes.py": "reads /proc about this machine's processes",
}
OS_FILE_OPS = frozenset(
    {
        "access", "chmod", "chown", "close", "fdopen", "fstat", "fsync", "fdatasync",
        "ftruncate", "link", "listdir", "lstat", "makedirs", "mkdir", "open", "pread",
        "preadv", "pwrite", "pwritev", "read", "readlink", "remove", "removedirs", "rename",
        "renames", "replace", "rmdir", "scandir", "stat", "statvfs", "symlink", "truncate",
        "unlink", "utime", "walk", "write",
    }
)  # fmt: skip
OS_PATH_QUERIES = frozenset(
    {
        "exists", "getatime", "getctime", "getmtime", "getsize", "isdir", "isfile", "islink",
        "ismount", "lexists", "realpath", "samefile",
    }
)  # fmt: skip
# pathlib's I/O methods by their positional arity: a storage method of the same name takes
# the path as its first argument (``fs.unlink(path)``), so it has one argument more
PATH_IO_ARITY = {
    "exists": 0, "glob": 1, "hardlink_to": 1, "is_dir": 0, "is_file": 0, "is_symlink": 0,
    "iterdir": 0, "lstat": 0, "mkdir": 0, "open": None, "read_bytes": 0, "read_text": 0,
    "readlink": 0, "rename": 1, "replace": 1, "resolve": 0, "rglob": 1, "rmdir": 0,
    "samefile": 1, "stat": 0, "symlink_to": 1, "touch": 0, "unlink": 0, "write_bytes": 1,
    "write_text": 1,
}  # fmt: skip
# ``dataclasses.replace(obj, field=...)`` and ``str.replace(a, b)`` are no file operations
_KEYWORDLESS = {"rename", "replace"}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _storage_bypasses(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "os.path", "shutil"):
            for alias in node.names:
                ops = {"os": OS_FILE_OPS, "os.path": OS_PATH_QUERIES}.get(node.module)
                if ops is None or alias.name in ops:
                    yield node.lineno, f"from {node.module} import {alias.name}"
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func) or ""
        head, _, attr = name.rpartition(".")
        file_call = (
            name in ("open", "io.open")
            or head == "shutil"
            or (head == "os" and attr in OS_FILE_OPS)
            or (head == "os.path" and attr in OS_PATH_QUERIES)
        )
        if file_call:
            yield node.lineno, f"{name}()"
        elif isinstance(node.func, ast.Attribute) and node.func.attr in PATH_IO_ARITY:
            arity = PATH_IO_ARITY[node.func.attr]
            if arity is not None and len(node.args) != arity:
                continue
            if node.func.attr in _KEYWORDLESS and node.keywords:
                continue
            yield node.lineno, f"Path I/O .{node.func.attr}()"


def storage_bypasses(root: Path = ROOT) -> list[PrivateUse]:
    """File operations in checkpoint modules other than the storage implementation:
    ``open()``, ``os`` file operations and path queries, ``shutil``, and pathlib's I/O
    methods. Everything else reaches files through a ``CheckpointStorage``."""
    found = []
    paths = [p for room in CHECKPOINT_ROOMS for p in (root / room).rglob("*.py")]
    for path in sorted(paths):
        rel = path.relative_to(root).as_posix()
        if rel in STORAGE_IO_OK:
            continue
        for line, text in _storage_bypasses(parse(path)):
            found.append(PrivateUse(rel, line, f"{text} outside the checkpoint storage"))
    return sorted(set(found), key=lambda u: (u.path, u.line, u.text))


# ------------------------------------------------------------------------------ output


def group_of(module: str) -> str:
    """The node a module belongs to in the room-level picture."""
    parts = module.split(".")
    if parts[0] != LIBRARY:
        return parts[0]
    if module == LIBRARY:
        return "fsdp_ext (top)"
    if module in COMMON:
        return module.split(".", 1)[1]
    return parts[1]


def room_edges(graph: Graph) -> dict[tuple[str, str], int]:
    """(from group, to group) -> number of import statements, explicit imports only."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for imp in graph.imports:
        a, b = group_of(imp.source), group_of(imp.target)
        if a != b and not imp.implicit:
            counts[(a, b)] += 1
    return dict(counts)


def to_text(graph: Graph) -> str:
    by_group: dict[str, set[str]] = defaultdict(set)
    for (a, b), _ in room_edges(graph).items():
        by_group[a].add(b)
    groups = sorted({group_of(m) for m in graph.modules})
    lines = [f"{g:<16} -> {', '.join(sorted(by_group[g])) or '(nothing)'}" for g in groups]
    return "\n".join(lines)


def to_dot(graph: Graph) -> str:
    lines = ["digraph imports {", "  rankdir=LR;", "  node [shape=box, fontsize=10];"]
    clusters: dict[str, list[str]] = defaultdict(list)
    for module in sorted(graph.modules):
        clusters[group_of(module)].append(module)
    for i, (group, modules) in enumerate(sorted(clusters.items())):
        lines.append(f'  subgraph cluster_{i} {{ label="{group}";')
        lines += [f'    "{m}";' for m in modules]
        lines.append("  }")
    seen = set()
    for imp in graph.imports:
        if imp.implicit or (imp.source, imp.target) in seen:
            continue
        seen.add((imp.source, imp.target))
        style = ' [style=dashed, label="local"]' if imp.local else ""
        lines.append(f'  "{imp.source}" -> "{imp.target}"{style};')
    lines.append("}")
    return "\n".join(lines) + "\n"


# Row of each group in the drawing, top to bottom: data flows downwards.
DRAW_ROWS = (
    ("examples", "benchmarks"),
    ("integrations", "fsdp_ext (top)", "testing", "lab"),
    ("pipeline", "job"),
    ("checkpoint",),
    ("moe",),
    ("comm", "wrap"),
    ("parallel_dims", "node_size", "_torch"),
    ("kernels",),
)


def draw_png(graph: Graph, path: Path) -> None:
    """The room-level graph: one box per room, an arrow per importing pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = room_edges(graph)
    present = {g for pair in edges for g in pair} | {group_of(m) for m in graph.modules}
    rows = [[g for g in row if g in present] for row in DRAW_ROWS]
    rows = [row for row in rows if row]
    placed = {g for row in rows for g in row}
    rows += [[g] for g in sorted(present - placed)]
    pos = {}
    for r, row in enumerate(rows):
        for c, group in enumerate(row):
            pos[group] = ((c + 1) / (len(row) + 1), 1 - (r + 0.5) / len(rows))
    fig, ax = plt.subplots(figsize=(9, 8))
    for (a, b), count in sorted(edges.items()):
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops={
                "arrowstyle": "-|>",
                "color": "tab:red" if y1 > y0 + 1e-9 else "0.45",
                "lw": 0.6 + 0.25 * min(count, 8),
                "shrinkA": 14,
                "shrinkB": 14,
                "connectionstyle": "arc3,rad=0.08",
            },
        )
    sizes = defaultdict(int)
    for module in graph.modules:
        sizes[group_of(module)] += 1
    for group, (x, y) in pos.items():
        label = group if sizes[group] <= 1 else f"{group}\n{sizes[group]} modules"
        ax.text(
            x,
            y,
            label,
            ha="center",
            va="center",
            fontsize=9,
            bbox={"boxstyle": "round", "fc": "white" if group != "_torch" else "#fde", "ec": "k"},
        )
    ax.set_axis_off()
    ax.set_title("fsdp-ext: who imports whom (an arrow upwards would be drawn red)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dot", type=Path, help="write every module's imports as Graphviz DOT")
    parser.add_argument("--png", type=Path, help="draw the rooms' imports (matplotlib)")
    parser.add_argument("--check", action="store_true", help="exit 1 on a broken rule")
    args = parser.parse_args(argv)
    graph = collect()
    print(to_text(graph))
    if args.dot:
        args.dot.write_text(to_dot(graph))
    if args.png:
        draw_png(graph, args.png)
    problems = [f"cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    problems += layering_violations(graph)
    problems += surface_problems(graph)
    problems += [f"private torch name: {u}" for u in private_torch_uses()]
    problems += [f"FSDP internals: {u}" for u in fsdp_internal_reads()]
    problems += [f"checkpoint file I/O: {u}" for u in storage_bypasses()]
    problems += [str(u) for u in frame_inspections()]
    for problem in problems:
        print(problem)
    print(f"{len(graph.modules)} modules, {len(problems)} problems")
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
