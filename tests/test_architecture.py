"""The house rules of docs/architecture.md, read from the source by scripts/import_graph.py.

No import cycle (function-local imports included); data flows examples/benchmarks ->
fsdp_ext -> fsdp_ext.kernels; a room imports another only through its ``__init__``; nothing
in the library imports ``integrations``, ``lab`` or ``testing``; benchmarks and examples
use public names only; every package re-exports one way (``__all__``); and private torch
names, and reads of FSDP2's internal objects (``group.fsdp_params``, ``group.mp_policy``), appear
only in ``fsdp_ext/_torch.py``. The checker itself is shown to catch each kind
of break on a small tree written here.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_checker():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts/import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ig = _load_checker()


@pytest.fixture(scope="module")
def graph():
    return ig.collect()


def test_no_import_cycle(graph):
    assert ig.cycles(graph) == []


def test_layering(graph):
    assert ig.layering_violations(graph) == []


def test_every_package_reexports_through_all(graph):
    assert ig.surface_problems(graph) == []


def test_private_torch_names_only_in_torch_shims():
    assert [str(u) for u in ig.private_torch_uses()] == []


def test_fsdp_internals_read_only_in_torch_shims():
    assert [str(u) for u in ig.fsdp_internal_reads()] == []


STRAGGLER = "fsdp_ext.straggler"  # a module of its own beside parallel_dims, not a room


def test_public_names_resolve():
    import fsdp_ext

    rooms = ["fsdp_ext", *(f"fsdp_ext.{r}" for r in ("checkpoint", "job", "comm", "moe"))]
    rooms += ["fsdp_ext.pipeline"]
    rooms += ["fsdp_ext.wrap", "fsdp_ext.testing", "fsdp_ext.integrations"]
    for name in rooms:
        module = importlib.import_module(name)
        assert sorted(module.__all__) == sorted(set(module.__all__)), name
        for public in module.__all__:
            assert hasattr(module, public), f"{name}.__all__ lists {public!r}"
    # the top package's names are its rooms' names, the same objects
    for public in fsdp_ext.__all__:
        owners = [
            importlib.import_module(r)
            for r in rooms[1:]
            if public in importlib.import_module(r).__all__
        ]
        owners += [importlib.import_module(m) for m in ("fsdp_ext.parallel_dims", STRAGGLER)]
        assert any(getattr(o, public, None) is getattr(fsdp_ext, public) for o in owners), public


def test_graph_script_writes_text_dot_and_png(tmp_path, capsys):
    assert ig.main(["--dot", str(tmp_path / "g.dot"), "--png", str(tmp_path / "g.png")]) == 0
    text = capsys.readouterr().out
    assert "wrap             -> _torch" in text
    dot = (tmp_path / "g.dot").read_text()
    assert '"fsdp_ext.wrap.apply" -> "fsdp_ext.wrap.plan";' in dot
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------- the checker catches each kind of break


def _tree(root: Path, files: dict[str, str]) -> Path:
    base = {
        "fsdp_ext/__init__.py": "from fsdp_ext.wrap import fully_shard\n"
        "__all__ = ['fully_shard']\n",
        "fsdp_ext/_torch.py": "def state(m):\n    return m._get_fsdp_state()\n",
        "fsdp_ext/wrap/__init__.py": "from fsdp_ext.wrap.a import fully_shard\n"
        "__all__ = ['fully_shard']\n",
        "fsdp_ext/wrap/a.py": "def fully_shard(m):\n    return m\n",
        "fsdp_ext/wrap/b.py": "",
        "fsdp_ext/comm/__init__.py": "from fsdp_ext.comm.x import hook\n__all__ = ['hook']\n",
        "fsdp_ext/comm/x.py": "def hook():\n    pass\n",
        "fsdp_ext/integrations/__init__.py": "__all__ = []\n",
        "fsdp_ext/integrations/acc.py": "from fsdp_ext.comm import hook\n",
        "fsdp_ext/kernels/__init__.py": "",
        "fsdp_ext/kernels/k.py": "",
        "benchmarks/bench.py": "import fsdp_ext\n",
        "examples/__init__.py": "",
    }
    for rel, text in {**base, **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _problems(root: Path) -> list[str]:
    graph = ig.collect(root)
    out = [" <-> ".join(c) for c in ig.cycles(graph)]
    out += ig.layering_violations(graph) + ig.surface_problems(graph)
    out += [str(u) for u in ig.private_torch_uses(root)]
    out += [str(u) for u in ig.fsdp_internal_reads(root)]
    return out


def test_checker_passes_a_clean_tree(tmp_path):
    assert _problems(_tree(tmp_path, {})) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # a cycle hidden by a function-local import
            {
                "fsdp_ext/wrap/a.py": "from fsdp_ext.wrap.b import g\ndef fully_shard(m):\n"
                "    return m\n",
                "fsdp_ext/wrap/b.py": "def g():\n    from fsdp_ext.wrap.a import fully_shard\n",
            },
            "fsdp_ext.wrap.a <-> fsdp_ext.wrap.b",
        ),
        (  # one room reaching into another's module
            {
                "fsdp_ext/comm/x.py": "from fsdp_ext.wrap.a import fully_shard\n"
                "def hook():\n    pass\n"
            },
            "fsdp_ext.comm.x imports fsdp_ext.wrap.a, a room's internals",
        ),
        (  # checkpoint I/O importing the run level built on it (the job room)
            {
                "fsdp_ext/checkpoint/__init__.py": "__all__ = []\n",
                "fsdp_ext/checkpoint/w.py": "from fsdp_ext.job import Checkpointer\n",
                "fsdp_ext/job/__init__.py": "from fsdp_ext.job.c import Checkpointer\n"
                "__all__ = ['Checkpointer']\n",
                "fsdp_ext/job/c.py": "from fsdp_ext.checkpoint.w import x\nCheckpointer = 1\n",
            },
            "fsdp_ext.checkpoint.w imports fsdp_ext.job, which is built on fsdp_ext.checkpoint",
        ),
        (  # a room importing the top package (which imports every room)
            {"fsdp_ext/comm/x.py": "def hook():\n    import fsdp_ext\n"},
            "imports the top package",
        ),
        (  # the library importing an outer room
            {"fsdp_ext/comm/x.py": "from fsdp_ext.integrations import acc\ndef hook():\n pass\n"},
            "fsdp_ext.integrations, which nothing inside the library may import",
        ),
        (  # kernels importing the library
            {"fsdp_ext/kernels/k.py": "import fsdp_ext\n"},
            "fsdp_ext.kernels.k imports fsdp_ext (an outer layer)",
        ),
        (  # a benchmark importing a name the package does not export
            {"benchmarks/bench.py": "from fsdp_ext.wrap import b\nfrom fsdp_ext.comm import x\n"},
            "benchmarks.bench imports fsdp_ext.comm.x, a room's internals",
        ),
        (  # names loaded on first use with nothing to load them
            {
                "fsdp_ext/comm/__init__.py": "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from fsdp_ext.comm.x import hook\n__all__ = ['hook']\n"
            },
            "fsdp_ext/comm/__init__.py: imports ['hook'] under TYPE_CHECKING, no __getattr__",
        ),
        (  # re-export by alias instead of __all__
            {"fsdp_ext/comm/__init__.py": "from fsdp_ext.comm.x import hook as hook\n"},
            "fsdp_ext/comm/__init__.py: no __all__",
        ),
        (  # a private torch module, outside strings and comments
            {"fsdp_ext/wrap/b.py": "from torch.distributed.fsdp._fully_shard import x\n"},
            "fsdp_ext/wrap/b.py:1: from torch.distributed.fsdp._fully_shard import x",
        ),
        (  # a private name from a public torch module
            {"benchmarks/bench.py": "from torch.distributed.fsdp.wrap import _Policy\n"},
            "import of private torch.distributed.fsdp.wrap._Policy",
        ),
        (  # FSDP2 state, as an attribute and through getattr
            {
                "fsdp_ext/wrap/b.py": "def f(m, p):\n    m._get_fsdp_state()\n"
                "    return getattr(p, '_unsharded_param', None)\n"
            },
            "fsdp_ext/wrap/b.py:3: private attribute _unsharded_param",
        ),
        (  # any other attribute this code base does not define itself
            {"examples/train.py": "def f(t):\n    return t._local_tensor + t._mystery\n"},
            "examples/train.py:2: private attribute _mystery",
        ),
    ],
)
def test_checker_catches(tmp_path, files, expected):
    problems = _problems(_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (  # the read that broke on torch 2.15 (FSDPParamGroup lost mp_policy)
            "def f(group):\n    return group.mp_policy.reduce_dtype\n",
            "fsdp_ext/comm/x.py:2: read of FSDP internal attribute .mp_policy",
        ),
        (  # through getattr
            "def f(group):\n    return getattr(group, 'fsdp_params', [])\n",
            "fsdp_ext/comm/x.py:2: read of FSDP internal attribute .fsdp_params",
        ),
        (  # a generic name on an object a shim handed out, via a loop and a subscript
            "from fsdp_ext._torch import param_groups\n"
            "def f(m):\n    for g in param_groups(m):\n        print(g.device)\n"
            "    gs = param_groups(m)\n    return gs[0].modules\n",
            "fsdp_ext/comm/x.py:6: attribute .modules read on FSDP object gs",
        ),
        (  # on a parameter annotated with an FSDP type, and on what it iterates
            "def f(group: 'FSDPParamGroup | None'):\n    return group.device\n",
            "fsdp_ext/comm/x.py:2: attribute .device read on FSDP object group",
        ),
        (
            "def f(group):\n    return [p.param_dtype for p in group.fsdp_params]\n",
            "fsdp_ext/comm/x.py:2: attribute .param_dtype read on FSDP object p",
        ),
    ],
)
def test_checker_catches_fsdp_internal_reads(tmp_path, code, expected):
    problems = _problems(_tree(tmp_path, {"fsdp_ext/comm/x.py": code}))
    assert expected in problems, problems
    # the same read inside the shims is where it belongs
    clean = _tree(tmp_path / "ok", {"fsdp_ext/_torch.py": code})
    assert not [p for p in _problems(clean) if "FSDP" in p], _problems(clean)


def test_checker_leaves_public_reads_alone(tmp_path):
    code = """
        from fsdp_ext._torch import group_device, param_groups
        def f(m, mp_policy, optimizer):
            groups = param_groups(m)
            device = group_device(groups[0])
            return device.type, mp_policy.param_dtype, optimizer.param_groups, m.modules()
        """
    assert _problems(_tree(tmp_path, {"fsdp_ext/comm/x.py": code})) == []


def test_checker_ignores_docstrings_comments_and_own_names(tmp_path):
    files = {
        "fsdp_ext/wrap/b.py": '''
            """As ``torch.testing._internal.common_fsdp`` does."""
            # torch.distributed._tensor was renamed
            class Box:
                def __init__(self):
                    self._value = 1

            def read(box):
                return box._value, "torch._C"
            ''',
    }
    assert _problems(_tree(tmp_path, files)) == []


# ------------------------------------------------- checkpoint file I/O only in its storage


def test_checkpoint_modules_touch_files_only_through_their_storage():
    assert [str(u) for u in ig.storage_bypasses()] == []


_LOOK_ALIKES = """\
import dataclasses, os
def f(fs, p, q, plan, s):
    fs.unlink(p); fs.rmdir(p); fs.readlink(p); fs.rename(p, q); fs.mkdir(p)
    fs.open_read(p).read(); fs.exists(p); fs.symlink("x", p)
    dataclasses.replace(plan, storage_data=1); s.replace("a", "b")
    return os.getpid(), os.environ.get("X"), os.fspath(p), os.path.join(p, "x")
"""


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("def f(p):\n    return open(p, 'rb')\n", "reader.py:8: open()"),
        ("import os\ndef f(p):\n    return os.open(p, 0)\n", "reader.py:9: os.open()"),
        ("import os\ndef f(p):\n    return os.path.lexists(p)\n", "os.path.lexists()"),
        ("from pathlib import Path\ndef f(p):\n    return Path(p).read_bytes()\n", ".read_bytes()"),
        ("def f(p):\n    p.unlink()\n", "Path I/O .unlink()"),
        ("def f(p, q):\n    p.replace(q)\n", "Path I/O .replace()"),
        ("def f(p):\n    return list(p.iterdir())\n", "Path I/O .iterdir()"),
        ("def f(p):\n    p.mkdir(parents=True)\n", "Path I/O .mkdir()"),
        ("from os import listdir\n", "from os import listdir"),
        ("import shutil\ndef f(p):\n    shutil.rmtree(p)\n", "shutil.rmtree()"),
    ],
)
def test_storage_checker_catches_a_planted_file_operation(tmp_path, code, expected):
    room = tmp_path / "fsdp_ext/checkpoint"
    room.mkdir(parents=True)
    (room / "fs.py").write_text(code)  # the storage itself may
    (room / "reader.py").write_text(_LOOK_ALIKES + code.replace("def f(", "def g("))
    found = [str(u) for u in ig.storage_bypasses(tmp_path)]
    assert len(found) == 1 and expected in found[0], found
    assert found[0].startswith("fsdp_ext/checkpoint/reader.py:")


# ------------------------------------------------- no frame inspection in the library


def test_the_library_does_not_inspect_stack_frames():
    assert [str(u) for u in ig.frame_inspections()] == []


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (
            "import sys\ndef f(t):\n    return sys._current_frames()[t]\n",
            "sys._current_frames in f",
        ),
        ("import sys\ndef f():\n    return sys._getframe(1).f_code\n", "sys._getframe in f"),
        ("import inspect\ndef f():\n    return inspect.stack()\n", "inspect.stack in f"),
        (
            "import inspect\nclass A:\n    def f(self):\n        return inspect.currentframe()\n",
            "inspect.currentframe in A.f",
        ),
        (
            "import traceback\nX = traceback.extract_stack()\n",
            "traceback.extract_stack in <module>",
        ),
        ("from sys import _getframe\n", "from sys import _getframe"),
        ("def f(frame):\n    return frame.f_back\n", "frame attribute .f_back in f"),
    ],
)
def test_frame_checker_catches(tmp_path, code, expected):
    room = tmp_path / "fsdp_ext/comm"
    room.mkdir(parents=True)
    (room / "x.py").write_text(code)
    (room / "y.py").write_text(
        "import sys, inspect\ndef f(e):\n    return sys.exc_info(), inspect.signature(f)\n"
    )
    found = [str(u) for u in ig.frame_inspections(tmp_path)]
    assert (
        len(found) == 1 and expected in found[0] and found[0].startswith("fsdp_ext/comm/x.py:")
    ), found


def test_frame_checker_allows_only_the_listed_function(tmp_path):
    (tmp_path / "fsdp_ext").mkdir()
    (tmp_path / "fsdp_ext/testing").mkdir()
    (tmp_path / "fsdp_ext/testing/gpu_counters.py").write_text(
        "import traceback\nclass HostSyncs:\n    def _record(self):\n"
        "        return traceback.extract_stack()\n"
        "    def other(self):\n        return traceback.extract_stack()\n"
    )
    found = [str(u) for u in ig.frame_inspections(tmp_path)]
    assert found == [
        "fsdp_ext/testing/gpu_counters.py:6: frame inspection: traceback.extract_stack in "
        "HostSyncs.other"
    ], found


# where a path's checkpoints are stored is decided in one place: fs.py defines LocalStorage,
# location.py resolves it (posix_storage), the package's __init__ re-exports it
LOCAL_STORAGE_MODULES = {
    "fsdp_ext/checkpoint/fs.py",
    "fsdp_ext/checkpoint/location.py",
    "fsdp_ext/checkpoint/__init__.py",
}


def _names_local_storage(root: Path) -> list[str]:
    """Library modules whose code (not text) names ``LocalStorage`` outside the allowed ones."""
    import ast

    found = []
    for path in sorted((root / "fsdp_ext").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in LOCAL_STORAGE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            named = (
                (isinstance(node, ast.Name) and node.id == "LocalStorage")
                or (isinstance(node, ast.Attribute) and node.attr == "LocalStorage")
                or (
                    isinstance(node, ast.ImportFrom)
                    and any(a.name == "LocalStorage" for a in node.names)
                )
            )
            if named:
                found.append(f"{rel}:{node.lineno}")
    return found


def test_local_storage_is_named_only_where_a_location_is_resolved(tmp_path):
    assert _names_local_storage(REPO) == []
    # the check bites: a module that hard-codes the default storage is named
    (tmp_path / "fsdp_ext/checkpoint").mkdir(parents=True)
    (tmp_path / "fsdp_ext/checkpoint/x.py").write_text(
        "from fsdp_ext.checkpoint.fs import LocalStorage\nfs = LocalStorage()\n"
        "doc = 'LocalStorage in text is fine'\n"
    )
    assert _names_local_storage(tmp_path) == [
        "fsdp_ext/checkpoint/x.py:1",
        "fsdp_ext/checkpoint/x.py:2",
    ]
