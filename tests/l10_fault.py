"""A 2-rank L10 engine whose follower dies or hangs in the middle of a run, for tests/test_l10_tp.py. Run as a
script, in a process of its own (torch.distributed's default group is one per process):

    python tests/l10_fault.py MODE TIMEOUT_S

MODE (rank 1 is signalled once a few steps have run):
  kill           SIGKILL rank 1 between two steps
  stop-in-step   SIGSTOP rank 1 just after rank 0 sent it a step, before rank 0 computes that step: rank 0 then
                 waits in an all-reduce of that step, which the compute group's timeout bounds
  stop           SIGSTOP rank 1 between two steps (it is waiting for rank 0's next message)

Rank 0 keeps stepping until the engine raises; then a stopped rank 1 is killed (whoever supervises a hung run
ends it) and the engine is closed. One JSON line on stdout, exit status 0:
    {"error": "RunFailure" or null, "message": str, "steps_after": int, "seconds_to_failure": float,
     "closed": bool}
A watchdog ends a run still going 2 * TIMEOUT_S + 6 seconds after the signal: it kills rank 1, prints
{"hung": "stepping" or "close", ...} and exits 3, so a hang is reported in seconds, not waited out.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lessons.l10_tensor_parallel import L10Engine  # noqa: E402
from lessons.l10_tensor_parallel.launch import start  # noqa: E402
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM  # noqa: E402
from shared.errors import RunFailure  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

STEPS_BEFORE = 3  # the prompts are prefilled and the first decodes have run when rank 1 is signalled
MAX_STEPS_AFTER = 60  # far more than the workload needs (32 new tokens): the run must fail long before
PROMPTS = ([9707, 11, 1879, 0], [785, 6722, 315, 9625, 374], list(range(1000, 1040)))


def follower() -> multiprocessing.Process:
    kids = [p for p in multiprocessing.active_children() if p.name == "tp-rank-1"]
    if len(kids) != 1:
        raise SystemExit(f"expected one follower process, found {multiprocessing.active_children()}")
    return kids[0]


def watchdog(seconds: float, where: dict) -> None:
    def fire() -> None:
        print(json.dumps({"hung": where["phase"], "after_s": seconds}), flush=True)
        rank1 = where.get("pid")
        if rank1:
            os.kill(rank1, signal.SIGKILL)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def main(mode: str, timeout_s: float) -> dict:
    group = start(2, torch.device("cpu"), timeout_s)
    model = TpQwen3ForCausalLM.load(default_model_dir(), torch.float32, group)
    engine = L10Engine(model, 16, 64, 8, "torch", graphs=False, max_batched_tokens=16)
    stop = StopRule(32, ignore_eos=True)
    for prompt in PROMPTS:
        engine.add_request(list(prompt), stop)
    for _ in range(STEPS_BEFORE):
        engine.step()
    rank1 = follower()
    where = {"phase": "stepping", "pid": rank1.pid}
    if mode == "kill":
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(timeout=30)  # gone for sure before rank 0's next step
    elif mode == "stop":
        os.kill(rank1.pid, signal.SIGSTOP)
    elif mode == "stop-in-step":
        send_then_run = engine.runner.run_step  # TpRunner.forward: lead("run_step", ...), then self.run_step

        def run_step(slices, copies):
            engine.runner.run_step = send_then_run  # once
            os.kill(rank1.pid, signal.SIGSTOP)  # rank 1 has been sent this step; rank 0 now computes it
            return send_then_run(slices, copies)

        engine.runner.run_step = run_step
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    watchdog(2 * timeout_s + 6, where)  # a bounded failure comes at about timeout_s; closing takes a moment more
    out = {"error": None, "message": "", "steps_after": 0, "closed": False}
    t0 = time.monotonic()
    try:
        while engine.scheduler.has_work() and out["steps_after"] < MAX_STEPS_AFTER:
            engine.step()
            out["steps_after"] += 1
    except RunFailure as e:
        out["error"], out["message"] = type(e).__name__, str(e)
    out["seconds_to_failure"] = time.monotonic() - t0
    if mode != "kill":
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(timeout=30)
    where["phase"] = "close"
    engine.close()
    out["closed"] = True
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], float(sys.argv[2]))), flush=True)
