"""torch.distributed from an MPI launch, and failure handling for every rank.

`mpirun -n N ...` starts N processes; `init_ep` reads rank and world size from MPI
(mpi4py), checks them against `--ep`, lets rank 0 pick a TCP port and shares it
through MPI (a raw int64 buffer: nothing is pickled), then initialises
torch.distributed: gloo on CPU, gloo for CPU tensors and NCCL for CUDA tensors on
GPUs. Two groups: the default one (MoE all-reduces, `COLLECTIVE_TIMEOUT`) and a
control group for rank 0's commands, whose waits may be long (rank 0 drafts,
selects, or runs other work between forwards) but block on sockets without
spinning a core.

Failures: `guarded` runs a rank's main; any exception prints one line naming the
rank, and MPI_Abort ends every rank. A rank killed outright cannot speak for itself,
and MPICH's launcher SIGKILLs the other ranks as soon as one dies, so `supervise`
splits each rank in two before MPI starts: the process the launcher sees waits for
its child, which runs the rank; when the child is killed the parent prints one line
naming the rank and the signal, and exits, and the launcher ends the job. The child
dies with its parent (PR_SET_PDEATHSIG), so killing either leaves no orphan. A peer
blocked in a collective when a rank dies also says which ranks are gone if it can.
`MOESPEC_EP_FAULT=rank:command:raise|kill` injects a failure for the tests.
"""

from __future__ import annotations

import datetime as _dt
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

COLLECTIVE_TIMEOUT = _dt.timedelta(seconds=300)  # a peer alive but stuck this long inside one forward is a failure
CONTROL_TIMEOUT = _dt.timedelta(days=7)  # workers wait for rank 0's next command
_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
FAULT_ENV = "MOESPEC_EP_FAULT"
# MPICH's launcher tears the job down as soon as a rank exits or aborts and may drop stderr it has not
# forwarded yet: a rank waits this long after its one error line before it ends (the line was seen
# lost in CI, once for a killed rank's supervisor, once for a rank that raised).
FORWARD_WAIT_S = 0.5


@dataclass(frozen=True)
class EPGroup:
    """This process's place in an expert-parallel job (torch.distributed is initialised)."""

    rank: int
    world_size: int
    device: torch.device  # this rank's device (cuda:<local rank> on GPUs)
    control: object  # torch.distributed ProcessGroup for rank 0's commands (gloo, CPU tensors)
    pids: tuple[int, ...]  # every rank's process id
    hosts: tuple[int, ...]  # every rank's host (a hash of its name): pids are comparable on one host only


def launched_world_size() -> int:
    """Ranks the MPI launcher started (1 without mpirun), from its environment: no MPI init needed."""
    return next((int(os.environ[k]) for k in _SIZE_ENV if k in os.environ), 1)


def launched_rank() -> int:
    """This process's rank from the MPI launcher's environment (0 without mpirun)."""
    return next((int(os.environ[k]) for k in _RANK_ENV if k in os.environ), 0)


def check_ep_launch(ep: int | None, world_size: int) -> int:
    """The EP size to run with, or ValueError for a launch that does not match `--ep`."""
    if ep is None:
        if world_size > 1:
            raise ValueError(f"mpirun started {world_size} ranks: pass --ep {world_size} to split the experts over them")
        return 1
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep!r}")
    if ep > 1 and world_size == 1:
        raise ValueError(f"--ep {ep} needs {ep} ranks: launch with `mpirun -n {ep} moespec ... --ep {ep}`")
    if world_size != ep:
        raise ValueError(f"mpirun started {world_size} ranks but --ep is {ep}: they must match")
    return ep


def init_ep(device: str | torch.device = "cpu") -> EPGroup:
    """Initialise torch.distributed over the MPI world (call on every rank, after check_ep_launch)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ValueError("expert parallelism needs mpi4py: pip install 'trtllm-moespec[mpi]'") from None
    import torch.distributed as dist

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    device = torch.device(device)
    if device.type == "cuda":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    address, port = _rendezvous(comm, MPI)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    ids = torch.tensor([os.getpid(), _host_id()], dtype=torch.int64)
    gathered = [torch.zeros_like(ids) for _ in range(size)]
    dist.all_gather(gathered, ids, group=control)
    return EPGroup(rank, size, device, control, tuple(int(g[0]) for g in gathered), tuple(int(g[1]) for g in gathered))


def _rendezvous(comm, MPI) -> tuple[str, int]:
    """Rank 0's address and a free port, shared through MPI as raw bytes."""
    one_host = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size() == comm.Get_size()
    buf = np.zeros(257, dtype=np.uint8)  # [port hi, port lo, name...]
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        name = ("127.0.0.1" if one_host else os.environ.get("MASTER_ADDR", socket.gethostname())).encode()[:255]
        buf[0], buf[1] = port >> 8, port & 0xFF
        buf[2 : 2 + len(name)] = np.frombuffer(name, dtype=np.uint8)
    comm.Bcast(buf, root=0)
    name = bytes(buf[2:]).rstrip(b"\0").decode()
    return name, int(buf[0]) << 8 | int(buf[1])


def _host_id() -> int:
    return int.from_bytes(socket.gethostname().encode()[:7].ljust(7, b"\0"), "little")


# ---------------------------------------------------------------------- failures
def supervise(rank: int) -> None:
    """Fork this rank (before any MPI or torch.distributed set-up). Returns in the child, which runs
    the rank; the parent never returns: it exits with the child's status, after one line naming the
    rank when the child was killed by a signal."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return  # forking an MPI-initialised process is unsafe: run unsupervised (peers still report a death)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with_parent(parent)
        return
    for sig in (signal.SIGINT, signal.SIGTERM):  # the launcher's signals reach the rank
        signal.signal(sig, lambda num, _: os.kill(child, num))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        os.write(2, f"moespec: error: rank {rank}: killed by {name}; stopping every rank\n".encode())
        time.sleep(FORWARD_WAIT_S)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status))


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux); no orphan survives a killed launcher process."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def guarded(rank: int, main: Callable[[], int], group: EPGroup | None = None) -> int:
    """Run one rank's `main`; on any failure print one line naming the rank and end every rank."""
    signal.signal(signal.SIGTERM, lambda *_: _on_terminate(rank, group))
    try:
        return main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure must end the whole job, not hang it
        print(f"moespec: error: rank {rank}: {describe_failure(e, rank, group)}", file=sys.stderr, flush=True)
        abort_all(1)


def describe_failure(error: BaseException, rank: int, group: EPGroup | None) -> str:
    """One line: which peer ranks are gone (if a collective broke), else the error itself."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if group is not None and _is_peer_failure(error):
        gone = _wait_for_dead_ranks(group)
        if gone:
            return f"rank {', '.join(map(str, gone))} ended unexpectedly; stopping every rank"
        return f"a peer rank ended unexpectedly ({text[:120]}); stopping every rank"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return f"{type(error).__name__}: {text}"


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("Connection closed", "Connection reset", "Read error", "Write error", "gloo", "NCCL"))


def _wait_for_dead_ranks(group: EPGroup, patience_s: float = 0.5) -> list[int]:
    """The peers that are gone; a killed process closes its sockets before it turns into a zombie,
    so a broken collective can be seen a moment before the peer's /proc entry says it died."""
    import time

    deadline = time.monotonic() + patience_s
    while True:
        gone = dead_ranks(group)
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.05)


def dead_ranks(group: EPGroup) -> list[int]:
    """Peer ranks on this host whose process is gone (exited, killed, or a zombie)."""
    me = group.hosts[group.rank]
    return [r for r, (pid, host) in enumerate(zip(group.pids, group.hosts))
            if r != group.rank and host == me and not _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    except OSError:  # no /proc: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _on_terminate(rank: int, group: EPGroup | None) -> None:
    gone = dead_ranks(group) if group is not None else []
    why = f" after rank {', '.join(map(str, gone))} ended" if gone else ""
    print(f"moespec: error: rank {rank}: stopped by the MPI launcher{why}", file=sys.stderr, flush=True)
    os._exit(143)


def abort_all(code: int) -> None:
    """End every rank of the job now (MPI_Abort), and this process in any case."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(FORWARD_WAIT_S)
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(code)
    except ImportError:
        pass
    os._exit(code)


def maybe_inject_fault(rank: int, command: int) -> None:
    """Test hook: `MOESPEC_EP_FAULT=rank:command:raise|kill` fails `rank` at its `command`-th command."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    fault_rank, fault_command, kind = spec.split(":")
    if int(fault_rank) != rank or int(fault_command) != command:
        return
    import time

    print(f"moespec: rank {rank}: injecting a fault ({kind}) at t={time.time():.3f}", file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault ({FAULT_ENV}={spec})")
