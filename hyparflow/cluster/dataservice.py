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
from typing import Any, Optional

__all__ = ["dispatcher", "worker", "serve", "bare"]


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
