"""`hyparflow data-service`: a tf.data service's dispatcher or one of its workers, as a
process that runs until stopped (SIGTERM or SIGINT stop it cleanly).

Each prints its address on one line as it starts (`hyparflow data-service: dispatcher
grpc://HOST:PORT`), the line a launcher or a user passes on to `hf.fit(...,
data_service=...)` and to the workers. A worker tells the dispatcher the name the
trainers reach it by (`--host`, else this machine's name), and its TensorFlow is not
the training ranks': its pools and tf.data's default pool have a thread per core, so
its pipelines fill the node.
"""

from __future__ import annotations

import signal
import socket
import threading
from typing import Any, List, Optional, Tuple

__all__ = ["dispatcher", "worker", "serve", "bare", "address", "start", "stop"]


def bare(address: str) -> str:
    """"grpc://HOST:PORT" or "HOST:PORT" -> "HOST:PORT" (what a worker config takes)."""
    return address.split("://", 1)[1] if "://" in address else address


def serve(server: Any, line: str, stop: Optional[threading.Event] = None) -> int:
    """Print `line`, then wait until SIGTERM or SIGINT (or `stop`), and stop `server`."""
    stop = stop or threading.Event()
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, lambda *_: stop.set())
    try:
        print(line, flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        server._stop()   # the servers' only stop (the public API has none)
    print(f"{line}: stopped", flush=True)
    return 0


def dispatcher(port: int = 0, host: Optional[str] = None,
               worker_timeout: Optional[float] = None,
               stop: Optional[threading.Event] = None) -> int:
    """Run a dispatcher on `port` (0: a free one) until stopped."""
    import tensorflow as tf

    config = tf.data.experimental.service.DispatcherConfig(
        port=port, **({} if worker_timeout is None
                      else {"worker_timeout_ms": int(worker_timeout * 1000)}))
    server = tf.data.experimental.service.DispatchServer(config)
    chosen = int(server.target.rsplit(":", 1)[1])
    return serve(server, f"hyparflow data-service: dispatcher grpc://"
                         f"{host or socket.gethostname()}:{chosen}", stop)


def worker(dispatcher_address: str, port: int = 0, host: Optional[str] = None,
           stop: Optional[threading.Event] = None) -> int:
    """Run a worker of the dispatcher at `dispatcher_address` until stopped."""
    import tensorflow as tf

    name = host or socket.gethostname()
    config = tf.data.experimental.service.WorkerConfig(
        dispatcher_address=bare(dispatcher_address), port=port,
        worker_address=f"{name}:%port%")
    server = tf.data.experimental.service.WorkerServer(config)
    chosen = server._address.rsplit(":", 1)[1]
    return serve(server, f"hyparflow data-service: worker {name}:{chosen} of "
                         f"grpc://{bare(dispatcher_address)}", stop)


def address(text: Any, what: str = "--data-service") -> str:
    """"grpc://HOST:PORT" for "HOST:PORT" or "grpc://HOST:PORT"; ValueError naming
    `what` (the flag or argument it came by) otherwise."""
    given = str(text).strip()
    host, _, port = bare(given).rpartition(":")
    if not host or not port.isdigit() or ("://" in given and not given.startswith("grpc://")):
        raise ValueError(f"{what} takes grpc://HOST:PORT (a dispatcher's address, printed "
                         f"by `hyparflow data-service --dispatcher`). Received: {text!r}")
    return f"grpc://{host}:{port}"


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the parent dies (Linux), so that a killed
    `hyparflow run` leaves no data service behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start(args: List[str], timeout: float, prefix: Tuple[str, ...] = ()) -> Tuple[Any, str]:
    """`hyparflow data-service ARGS` as a child (through `prefix`: an srun step's
    command): (process, the address it printed)."""
    import subprocess
    import sys

    process = subprocess.Popen([*prefix, sys.executable, "-m", "hyparflow", "data-service",
                                *args],
                               stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    timer = threading.Timer(timeout, process.kill)   # a process that prints nothing: no hang
    timer.start()
    try:
        line = process.stdout.readline() if process.stdout is not None else ""
    finally:
        timer.cancel()
    if "hyparflow data-service:" not in line:
        process.kill()
        raise RuntimeError(f"`hyparflow data-service {' '.join(args)}` did not start "
                           f"(it printed {line.strip()!r})")
    return process, line.split()[3]


def start(workers: int, host: Optional[str] = "localhost", timeout: float = 120,
          prefix: Tuple[str, ...] = ()) -> Tuple[List[Any], str]:
    """A dispatcher and `workers` workers, as children: on this node, or each as what
    `prefix` starts (an srun step, which names its node when `host` is None): (the
    processes, the dispatcher's address). `stop` ends them."""
    processes: List[Any] = []
    named = ["--host", host] if host else []
    try:
        dispatcher, where = _start(["--dispatcher", *named], timeout, prefix)
        processes.append(dispatcher)
        for _ in range(workers):
            processes.append(_start(["--worker", where, *named], timeout, prefix)[0])
    except BaseException:
        stop(processes)
        raise
    return processes, where


def stop(processes: List[Any], grace: float = 30) -> None:
    """SIGTERM to each (workers first), then SIGKILL to any still running after `grace`."""
    import subprocess

    for process in processes[::-1]:
        if process.poll() is None:
            process.terminate()
    for process in processes[::-1]:
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
