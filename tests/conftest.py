"""CPU runs put Triton in interpreter mode before anything imports it; tests marked `gpu` run
only where CUDA is available (the device machine: `pytest -m gpu`)."""

import gc
import os
import weakref
from collections.abc import Callable

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run: a CI failure is then reproducible here.
settings.register_profile("memplan", derandomize=True, deadline=None)
settings.load_profile("memplan")


def pytest_configure(config):
    """Each xdist worker (`pytest -n N`) runs torch on its share of the cores: N workers with as
    many threads as there are cores spin against each other (on 2 cores under -n 2 the
    patched-model tests take up to twice as long)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def validated_versions(monkeypatch):
    """memplan reads the installed versions as one of its validated setups, so what it prints
    does not depend on where the tests run (tests/test_versions.py checks the warning itself)."""
    import memplan.versions

    ci = next(v for v in memplan.versions.VALIDATED if v.gpu is None)
    pinned = {"torch": ci.torch, "triton": ci.triton, "transformers": ci.transformers}
    monkeypatch.setattr(memplan.versions, "installed_versions", lambda: dict(pinned))


@pytest.fixture(autouse=True)
def release_cached_gpu_memory(request):
    """A GPU test hands its cached blocks back to the driver when it ends: the tests that run
    a fresh process (memplan verify's child) need the GPU that earlier tests cached."""
    yield
    if HAS_GPU and "gpu" in request.keywords:
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_GPU else "cpu"


def _saved_storage_bytes(run: Callable[[], object], module: torch.nn.Module) -> int:
    """Bytes of the unique storages autograd saves while `run()` executes, the module's
    parameters excluded. Where `run()` returns its output (which holds the graph), only the
    storages still saved once it returns count: a node freed inside the forward (a router's
    top-k over values it discards) keeps nothing for backward."""
    excluded = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: list[tuple[weakref.ref, int, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded:
            saved.append((weakref.ref(t), ptr, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = run()
    kept = (entry for entry in saved if output is None or entry[0]() is not None)
    storages = {ptr: nbytes for _, ptr, nbytes in kept}
    del output
    return sum(storages.values())


@pytest.fixture
def saved_storage_bytes() -> Callable[[Callable[[], object], torch.nn.Module], int]:
    return _saved_storage_bytes


class _NewStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Storages of more than 1000 elements created by the ops run under it."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.set_:
            # points a tensor at an existing storage (Triton's interpreter does, around launches)
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > 1000:
                if t.untyped_storage().data_ptr() not in known:
                    self.sizes.append((str(func), tuple(t.shape)))
        return out


@pytest.fixture
def new_storages() -> type[_NewStorages]:
    return _NewStorages


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of the storages the ops run under it create that are alive, now (`current`)
    and at most (`peak`); a storage counts until its last tensor or autograd node lets go."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def _release(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.set_:  # Triton's interpreter, around launches
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._sizes or not storage.nbytes():
                continue
            self._sizes[key] = storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda _, k=key: self._release(k))
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        return out


@pytest.fixture
def live_bytes() -> type[_LiveBytes]:
    return _LiveBytes
