"""The shm_broadcast reader's busy loop through vLLM's own MessageQueue, between processes.

Run in a subprocess whose PYTHONPATH puts a vLLM tree first: ``python spin_checks.py SITE``.
Prints one JSON object after @@RESULTS@@: for each value of VLLM_SHM_BROADCAST_BUSY_LOOP_S
(unset, "1", and two bad ones), what a reader built by vLLM's own
``MessageQueue.create_from_handle`` in a process of its own (spawned, as vLLM's workers are)
reports: its SpinCondition's ``busy_loop_s``, and the CPU seconds it used while it waited
``WAIT_S`` for the writer's next message (busy-looping for ``busy_loop_s``, then parked on the
writer's notify socket); or the error its construction raised. Also whether vllm.envs registers
the variable. The same on vLLM 0.28.0 and 0.32.0 (shm_broadcast.MessageQueue and its
SpinCondition are where 0013 left them).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import traceback

WAIT_S = 1.5  # the writer's pause between its two messages (longer than vLLM's 1 s busy loop)
ENV = "VLLM_SHM_BROADCAST_BUSY_LOOP_S"


def reader(handle, conn) -> None:
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        mq = MessageQueue.create_from_handle(handle, 0)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    conn.send({"busy_loop_s": mq._spin_condition.busy_loop_s})
    mq.wait_until_ready()
    assert mq.dequeue() == "first"
    cpu0, wall0 = time.process_time(), time.monotonic()
    assert mq.dequeue() == "second"
    conn.send({"wait_cpu_s": round(time.process_time() - cpu0, 3),
               "wait_wall_s": round(time.monotonic() - wall0, 3)})


def one(value: str | None) -> dict:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    if value is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = value
    ctx = mp.get_context("spawn")
    mq = MessageQueue(1, 1)  # the writer: one reader, local (shared memory + notify socket)
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=reader, args=(mq.export_handle(), theirs))
    proc.start()
    try:
        out = ours.recv()
        if "error" in out:
            return out
        mq.wait_until_ready()
        mq.enqueue("first")
        time.sleep(WAIT_S)
        mq.enqueue("second")
        out.update(ours.recv())
        return out
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    results: dict[str, str] = {}
    for value in (None, "1", "-1", "2ms"):
        try:
            results[f"{ENV}={value}" if value is not None else f"{ENV} unset"] = json.dumps(one(value))
        except Exception:
            results[f"{ENV}={value}"] = traceback.format_exc()
    os.environ.pop(ENV, None)
    try:
        import vllm.envs as envs

        results["compile_factors ignore it"] = json.dumps(ENV not in envs.compile_factors())
        # Registered: vLLM's strict check of VLLM_* names takes the name (envs.validate_environ
        # on 0.28.0; on 0.32.0 vllm/platforms/interface.py Platform.validate_environ, which
        # EngineArgs.create_engine_config calls): both look it up in envs.environment_variables.
        results["registered in vllm.envs"] = json.dumps(ENV in envs.environment_variables)
    except Exception:
        results.setdefault("compile_factors ignore it", traceback.format_exc())
        results.setdefault("registered in vllm.envs", json.dumps(traceback.format_exc()))
    print("@@RESULTS@@" + json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
