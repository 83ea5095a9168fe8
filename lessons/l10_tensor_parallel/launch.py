"""Starting the ranks. Rank 0 is the process the user ran (the smoke, the server); it runs the scheduler.

    python scripts/l10_smoke.py --tp 2                       # rank 0 spawns rank 1 (torch.multiprocessing)
    torchrun --nproc-per-node 2 scripts/l10_smoke.py --tp 2  # torchrun starts both; rank 1 only follows

Spawned ranks meet at a FileStore in a private folder (mode 0700, removed at close) and their gloo sockets
are bound to the loopback interface: nobody else on the machine can reach the store, and no other machine
can reach the ranks. (A TCPStore listens on every interface, unauthenticated, whatever host it is given.)
Under torchrun the ranks may be on several machines: they meet at torchrun's TCPStore, and the network
between them must be trusted, as torch.distributed itself requires. Either way rank 0 writes the device
type to the store, and every rank joins the same two process groups (group.py). Under torchrun the
followers run the same script: `follow_if_torchrun` at its top sends them into the follower loop before
they parse a single option.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lessons.l10_tensor_parallel.group import DEFAULT_TIMEOUT_S, IDLE_TIMEOUT, STARTUP_TIMEOUT_S, TpGroup
from shared.errors import CourseError, RunFailure

LOOPBACK = "lo"  # the interface spawned ranks' gloo sockets bind to (they share one machine)
# Waiting for the ranks to start (a fresh interpreter imports torch: seconds), apart from the step timeout,
# which may be short: a rank that is still starting has not hung.
STARTUP_TIMEOUT = timedelta(seconds=STARTUP_TIMEOUT_S)


def start(tp: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> TpGroup:
    """Rank 0's group of `tp` ranks: joined under torchrun, else with tp - 1 follower processes spawned here."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise CourseError(f"--tp must be at least 1, got {tp!r}")
    if not timeout_s > 0:
        raise CourseError(f"--tp-timeout must be above 0 seconds, got {timeout_s!r}")
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        raise CourseError(f"--tp {tp} needs {tp} GPUs (one per rank); torch sees {torch.cuda.device_count()}")
    if torchrun_rank() is not None:
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise CourseError(f"--tp {tp}, but torchrun started {world} processes: give --nproc-per-node {tp}")
        return _join(0, tp, _torchrun_store(0, tp), timeout_s, device.type)
    if tp == 1:
        return TpGroup(0, 1, device, timeout_s)  # nothing to talk to: every collective is a no-op
    if device.type == "cuda":  # NCCL reads it when its communicator starts, at the first collective: kept set
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK)  # its bootstrap sockets (by reading; no GPUs here)
    folder = Path(tempfile.mkdtemp(prefix="l10-tp-"))  # mode 0700: this user's processes only
    store_path = str(folder / "store")
    spawn = mp.get_context("spawn")  # a fresh interpreter per rank: fork would copy torch's threads and CUDA state
    followers = [spawn.Process(target=_spawned_follower, daemon=True, name=f"tp-rank-{rank}",
                               args=(rank, tp, store_path, torch.get_num_threads()))
                 for rank in range(1, tp)]
    for p in followers:
        p.start()
    try:
        with _gloo_on(LOOPBACK):
            group = _join(0, tp, _file_store(store_path, tp), timeout_s, device.type)
    except RunFailure:
        _stop(followers)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    group.on_close += [lambda: _stop(followers), lambda: shutil.rmtree(folder, ignore_errors=True)]
    atexit.register(group.close)  # however rank 0 ends, its followers do not outlive it
    return group


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it, else None."""
    return int(os.environ["RANK"]) if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ else None


def follow_if_torchrun() -> None:
    """At the top of a script torchrun may start: ranks above 0 follow rank 0, then exit (never returning)."""
    rank = torchrun_rank()
    if rank is None or rank == 0:
        return
    world = int(os.environ["WORLD_SIZE"])
    _follow(rank, lambda: _torchrun_store(rank, world), world)


def _spawned_follower(rank: int, size: int, store_path: str, threads: int) -> None:
    torch.set_num_threads(threads)  # the same as rank 0's: the ranks' steps should take the same time
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = LOOPBACK  # it exists only to be this rank
    _follow(rank, lambda: _file_store(store_path, size), size)


def _file_store(path: str, size: int) -> dist.FileStore:
    store = dist.FileStore(path, size)
    store.set_timeout(STARTUP_TIMEOUT)  # a rank that never comes is an error in minutes, not a hang
    return store


@contextmanager
def _gloo_on(interface: str) -> Iterator[None]:
    """gloo binds the sockets of the groups created here to `interface` (it reads GLOO_SOCKET_IFNAME when a
    group is created); rank 0 is the user's process, so its environment is restored afterwards."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before


def _follow(rank: int, make_store, size: int) -> None:
    from lessons.l10_tensor_parallel.follower import follow  # the follower loop needs the model; import it here

    try:
        group = _join(rank, size, make_store(), None, None)
        follow(group)
        group.close()
    except (CourseError, RunFailure) as e:
        print(f"error: {e}" if isinstance(e, RunFailure) else f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    except KeyboardInterrupt:
        raise SystemExit(1)
    raise SystemExit(0)


def _torchrun_store(rank: int, size: int) -> dist.TCPStore:
    # torchrun's agent may host the store itself (then every rank is a client), as torch's env:// init does.
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                         is_master=rank == 0 and not agent_hosts, timeout=STARTUP_TIMEOUT)


def _join(rank: int, size: int, store: dist.Store, timeout_s: float | None, device_type: str | None) -> TpGroup:
    """Every rank: meet at the store, join both groups. Rank 0 says which device and timeout; the others read them."""
    try:
        if rank == 0:
            store.set("tp/device", device_type)
            store.set("tp/timeout", str(timeout_s))
            store.wait([f"tp/started/{r}" for r in range(1, size)], STARTUP_TIMEOUT)  # then every wait is a step's
        else:
            store.set(f"tp/started/{rank}", "1")
        device_type, timeout_s = store.get("tp/device").decode(), float(store.get("tp/timeout"))
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        # A timeout is each process's own: rank 0's sends are bounded (group.py waits for a step's send up to
        # the step timeout, for the others up to STARTUP_TIMEOUT, gloo's own), a follower's wait for the next
        # step is not (the server may idle for hours).
        control = dist.new_group(backend="gloo", timeout=max(STARTUP_TIMEOUT, timedelta(seconds=timeout_s))
                                 if rank == 0 else IDLE_TIMEOUT)
    except RuntimeError as e:  # DistStoreError and gloo's errors are RuntimeErrors
        raise RunFailure(f"tensor-parallel rank {rank} of {size} could not join the group: "
                         f"{str(e).strip().splitlines()[0]}") from None
    return TpGroup(rank, size, device, timeout_s, compute=dist.group.WORLD, control=control)


def _stop(followers: list) -> None:
    """Give the followers a moment to exit on their own (they were told to stop), then end them."""
    for p in followers:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
