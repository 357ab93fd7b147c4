"""What replicator trusts: no code from peers or checkpoints, and a local job's sockets on loopback.

The static checks walk the package's syntax trees, so a new `pickle.loads` or an
`all_gather_object` anywhere in the core fails here with its file and line. The checkpoint
tests plant a payload that would run code (it creates a directory) in a checkpoint's
metadata and in one of its tensor entries, show that plain unpickling does run it, and check
that replicator refuses both and runs neither. A symlink planted under a shared-memory
segment's name must not be followed. The last tests ask torch's own rendezvous code what
`replicator launch` on one machine would listen on. Known gaps are strict expected failures:
they start failing once fixed, so the marker and docs/concepts/reliability.md get updated. See
docs/concepts/reliability.md, Security.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import pickle
import secrets
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import replicator
from replicator import checkpoint
from replicator.launch import LaunchSpec, _environment, torchrun_arguments

PACKAGE = Path(replicator.__file__).resolve().parent
ROOT = PACKAGE.parent
# The test helpers talk to their own child processes (run_replicas pickles results between a
# parent and the children it started); they are not part of a user's job.
EXEMPT = PACKAGE / "testing"

# torch.distributed's *_object collectives unpickle whatever bytes a peer sends.
PEER_OBJECT_CALLS = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                     "send_object_list", "recv_object_list"}
CODE_CALLS = {"eval", "exec", "compile", "__import__"}
# The one import of code by name: `replicator plan --model-from package.module:factory`, a module the user
# names on their own command line, as `python -m` does; never a name that comes from a peer or a file.
IMPORTS_BY_NAME = {"replicator/cli/plan.py"}
UNPICKLING = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("marshal", "load"),
              ("marshal", "loads"), ("shelve", "open"), ("dill", "load"), ("dill", "loads"), ("yaml", "load"),
              ("yaml", "unsafe_load"), ("cloudpickle", "load"), ("cloudpickle", "loads")}


def _sources(include_testing: bool = False) -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10, f"found only {len(files)} source files under {PACKAGE}"
    return [f for f in files if include_testing or EXEMPT not in f.parents]


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _calls(path: Path) -> list[tuple[ast.Call, str, str]]:
    """Every call as (node, owner, name): `pickle.loads(x)` -> ("pickle", "loads"), `eval(x)` -> ("", "eval"),
    `torch.distributed.all_gather_object(...)` -> ("distributed", "all_gather_object")."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                found.append((node, "", func.id))
            elif isinstance(func, ast.Attribute):
                owner = func.value
                name = (owner.id if isinstance(owner, ast.Name)
                        else owner.attr if isinstance(owner, ast.Attribute) else "")
                found.append((node, name, func.attr))
    return found


def _imports(path: Path) -> list[tuple[ast.AST, str, str | None]]:
    """Every import as (node, module, name): `import pickle` -> ("pickle", None), `from a import b` -> ("a", "b")."""
    found: list[tuple[ast.AST, str, str | None]] = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found += [(node, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node, node.module or "", alias.name) for alias in node.names]
    return found


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_the_core_never_evaluates_code() -> None:
    offenders = [_where(path, node) for path in _sources() for node, owner, name in _calls(path)
                 if (not owner and name in CODE_CALLS)
                 or (owner == "importlib" and name == "import_module"
                     and str(path.relative_to(ROOT)) not in IMPORTS_BY_NAME)]
    assert not offenders, f"eval/exec/compile/__import__ in the core: {offenders}"


def test_the_core_never_unpickles_except_through_an_allow_list() -> None:
    offenders = [_where(path, node) for path in _sources() for node, owner, name in _calls(path)
                 if (owner, name) in UNPICKLING]
    assert not offenders, f"unrestricted deserialisation in the core: {offenders}"
    serialisers = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "yaml", "_pickle"}
    importers = [(path, node, module, name) for path in _sources() for node, module, name in _imports(path)
                 if module.split(".")[0] in serialisers]
    # checkpoint/safe_load.py needs `import pickle` for the allow-list unpickler's base class; anything
    # else (an alias, `from pickle import loads`) would slip past the call check above.
    unexpected = [_where(path, node) for path, node, module, name in importers
                  if not (path == PACKAGE / "checkpoint" / "safe_load.py" and module == "pickle" and name is None)]
    assert not unexpected, f"deserialisers imported in the core: {unexpected}"
    # The one unpickler allowed (DCP's .metadata) must decide what it builds: it overrides find_class.
    unpicklers = []
    for path in _sources():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("Unpickler") for base in node.bases):
                methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
                unpicklers.append((_where(path, node), "find_class" in methods))
    assert unpicklers, "checkpoint/safe_load.py's restricted unpickler was not found: has the check gone stale?"
    assert all(restricted for _, restricted in unpicklers), f"an Unpickler without find_class: {unpicklers}"


def test_the_core_never_unpickles_what_peers_send() -> None:
    offenders = [f"{_where(path, node)} {name}" for path in _sources() for node, _, name in _calls(path)
                 if name in PEER_OBJECT_CALLS]
    offenders += [f"{_where(path, node)} imports {name}" for path in _sources() for node, _, name in _imports(path)
                  if name in PEER_OBJECT_CALLS]
    assert not offenders, f"collectives that unpickle peer data: {offenders}"


def test_every_torch_load_is_weights_only() -> None:
    loads = [(path, node) for path in _sources(include_testing=True) for node, owner, name in _calls(path)
             if owner == "torch" and name == "load"]
    unsafe = [_where(path, node) for path, node in loads
              if not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in node.keywords)]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


def test_no_shell_commands() -> None:
    offenders = []
    for path in _sources(include_testing=True):
        for node, owner, name in _calls(path):
            if owner == "os" and name in ("system", "popen"):
                offenders.append(_where(path, node))
            if any(k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                   for k in node.keywords):
                offenders.append(_where(path, node))
    assert not offenders, f"shell command lines: {offenders}"


# -- checkpoints: a planted payload is refused, never run ------------------------------------------
class _Payload:
    """Unpickling this creates a directory: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.mkdir, (str(self.marker),)


def _checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = torch.nn.Linear(3, 2)
    path = checkpoint.save(tmp_path / "ckpt" / "step_000000001", modules=model, step=1)
    return path, model


def test_checkpoint_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path, model = _checkpoint(tmp_path)
    marker = tmp_path / "ran"
    evil = pickle.dumps(_Payload(marker))
    pickle.loads(evil)  # the payload is live: ordinary unpickling runs it
    assert marker.is_dir()
    marker.rmdir()
    (path / ".metadata").write_bytes(evil)
    with pytest.raises(checkpoint.CheckpointError, match="refusing to load"):
        checkpoint.restore(path, modules=model)
    assert not marker.exists(), "restoring the checkpoint ran code from its metadata"


def test_a_checkpoint_entry_holding_pickled_code_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    path, model = _checkpoint(tmp_path)
    marker = tmp_path / "ran"
    # Rewrite the tensors with DCP itself, the weight replaced by an object DCP pickles.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group: intended here
        dcp.save({"model.weight": _Payload(marker), "model.bias": torch.zeros(2)},
                 storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        assert not marker.exists()
        loaded = {"model.weight": torch.zeros(2, 3), "model.bias": torch.zeros(2)}
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(path), no_dist=True)  # torch's own reader runs it
        assert marker.is_dir()
        marker.rmdir()
        with pytest.raises(checkpoint.CheckpointError, match="model.weight"):
            checkpoint.restore(path, modules=model)
    assert not marker.exists(), "restoring the checkpoint ran code from one of its entries"


# -- shared memory: a name planted in /dev/shm is refused, not followed ---------------------------
def test_a_shared_memory_segment_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    shared_memory = pytest.importorskip("replicator.sync.reducers.shm")
    directory = Path(shared_memory.SHARED_MEMORY_DIR)
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        pytest.skip(f"{directory} is not writable here")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    # /dev/shm is world-writable: anyone who saw one segment's name there can guess the next one's.
    planted = directory / f"replicator-test-{secrets.token_hex(8)}-staging0"
    planted.symlink_to(victim)
    try:
        with contextlib.suppress(OSError):  # refusing the name (ELOOP, PermissionError) is the right answer
            shared_memory._Segment(str(planted), 2, 16, torch.float32)
    finally:
        planted.unlink()
    assert victim.read_bytes() == b"precious", "the segment followed the symlink and overwrote its target"


# -- the rendezvous of a single-node launch ---------------------------------------------------------
def _rendezvous_host(arguments: list[str]) -> str:
    """The host torchrun's agents rendezvous at: --master-addr, or the host of --rdzv-endpoint."""
    if "--master-addr" in arguments:
        return arguments[arguments.index("--master-addr") + 1]
    return arguments[arguments.index("--rdzv-endpoint") + 1].rsplit(":", 1)[0]


def test_a_single_node_launch_rendezvous_and_gloo_use_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    spec = LaunchSpec(target="train.py", args=[], nproc_per_node=4)
    assert _rendezvous_host(torchrun_arguments(spec)) == "127.0.0.1"
    assert _environment(spec)["GLOO_SOCKET_IFNAME"] == "lo"
    nodes = LaunchSpec(target="train.py", args=[], nnodes=2, master="10.1.2.3:29400")
    assert _rendezvous_host(torchrun_arguments(nodes)) == "10.1.2.3"
    assert "GLOO_SOCKET_IFNAME" not in _environment(nodes)  # the user picks the interface across nodes


# Builds the rendezvous store exactly as torchrun's agent would for `replicator launch -n 1 ...`
# (torchrun's own argument parsing and rendezvous registry), joins a one-process Gloo group with
# the launcher's environment, and lists the TCP sockets this process listens on.
_PROBE = r"""
import json, os, socket, sys
from replicator import launch
from replicator.launch import LaunchSpec, _environment, torchrun_arguments
spec = LaunchSpec(target=sys.argv[1], args=[], nproc_per_node=1)
os.environ.update(_environment(spec))
getattr(launch, "_register_rendezvous", lambda: None)()  # a rendezvous backend of replicator's own, if any
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.run import config_from_args, parse_args

config, _, _ = config_from_args(parse_args(torchrun_arguments(spec)))
params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                              min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
                              **config.rdzv_configs)
rendezvous = get_rendezvous_handler(params).next_rendezvous()

def listening():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
                found.append([socket.inet_ntop(family, raw), int(port, 16)])
    return found

store = listening()
dist.init_process_group("gloo", store=rendezvous.store, rank=0, world_size=1)
gloo = [entry for entry in listening() if entry not in store]
dist.destroy_process_group()
print(json.dumps({"endpoint": config.rdzv_endpoint, "store": store, "gloo": gloo}))
"""
_LOOPBACK = ("127.", "::1", "::ffff:127.")


@pytest.fixture(scope="module")
def listening(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not Path("/proc/self/net/tcp").exists():
        pytest.skip("needs Linux /proc to list listening sockets")
    script = tmp_path_factory.mktemp("probe") / "train.py"
    script.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _PROBE, str(script)], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gloo_of_a_single_node_launch_listens_on_loopback_only(listening: dict) -> None:
    assert listening["gloo"], f"no Gloo listener found: {listening}"
    assert all(host.startswith(_LOOPBACK) for host, _ in listening["gloo"]), listening


def test_the_rendezvous_store_of_a_single_node_launch_listens_on_loopback_only(listening: dict) -> None:
    assert listening["store"], f"no store listener found: {listening}"
    assert all(host.startswith(_LOOPBACK) for host, _ in listening["store"]), listening
