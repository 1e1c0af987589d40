"""Decoding on other nodes: each replica's part of the data produced by the workers of
a tf.data service (`hf.fit(..., data_service="grpc://HOST:PORT")`) and read over gRPC by
the replica's reader, which hands the batches on as it does a part it decodes itself.

Two modes:

  exact    replica r's part, for one pass, is ONE job of ONE split (`range(1).flat_map`
           under ShardingPolicy.DYNAMIC): a single worker produces the whole part, in
           order, so the replica reads exactly what it would read in place (model.fit's
           weights on the replicas' batches put together). Up to R workers are busy.
           The worker appends an end marker: a stream cut short (its worker lost: the
           dispatcher gives a split out at most once) is an error naming the service,
           never an epoch silently shorter.
  dynamic  ShardingPolicy.DYNAMIC on the part itself: its files are split among all
           the workers as they ask for work (every worker busy), each file read at most
           once, in no fixed order: the same training only statistically.

A lost worker, in either mode, leaves its reader waiting without end (TensorFlow 2.21
neither replaces it nor gives its split to another): each batch is awaited at most
HYPARFLOW_DATA_SERVICE_TIMEOUT seconds, then every rank ends naming the service.

Jobs are named by a run id drawn on rank 0 and shared (so no two fits or passes
collide), the replica and the pass. A dispatcher that does not answer a TCP connect
within `PROBE_SECONDS` is an error naming its address (TensorFlow's own client retries
for minutes).
"""

import itertools
import socket
import threading
import uuid

from .. import settings
from ..cluster import dataservice

__all__ = ["MODES", "Service", "resolve", "probe", "target", "PROBE_SECONDS"]

MODES = ("exact", "dynamic")
PROBE_SECONDS = 10.0
# The element's flag: a batch, the worker's end marker, the reader's own tail.
_BATCH, _END, _TAIL = 0, 1, 2


def target(address):
    """("grpc://HOST:PORT", HOST, PORT) for "grpc://HOST:PORT" or "HOST:PORT"."""
    full = dataservice.address(address, "data_service")
    host, _, port = dataservice.bare(full).rpartition(":")
    return full, host.strip("[]"), int(port)


def probe(address, seconds=PROBE_SECONDS):
    """Raise ConnectionError naming `address` unless its dispatcher takes a TCP
    connection within `seconds`."""
    import time

    full, host, port = target(address)
    deadline = time.monotonic() + seconds
    while True:   # refused: tried again until the deadline (a dispatcher starting beside us)
        try:
            left = deadline - time.monotonic()
            socket.create_connection((host, port), timeout=max(0.1, left)).close()
            return
        except OSError as error:
            if time.monotonic() + 0.5 >= deadline:
                failure = error
                break
        time.sleep(0.5)
    raise ConnectionError(
        f"The tf.data service dispatcher at {full} cannot be reached within {seconds:.0f} s "
        f"({failure}). Start it (`hyparflow data-service --dispatcher --port {port}` on "
        f"{host}), or leave data_service (and HYPARFLOW_DATA_SERVICE) unset to decode in "
        "place.")


def resolve(address=None, mode=None):
    """A Service for `fit`'s data_service / data_service_mode (else HYPARFLOW_DATA_SERVICE
    and HYPARFLOW_DATA_SERVICE_MODE), or None when no service is named."""
    address = address if address is not None else settings.data_service()
    mode = mode if mode is not None else (settings.data_service_mode() or "exact")
    if mode not in MODES:
        raise ValueError(f"data_service_mode must be one of {MODES}: 'exact' gives "
                         f"model.fit's weights, 'dynamic' balances the workers. Received: "
                         f"{mode!r}")
    if address is None or not str(address).strip():
        return None
    return Service(target(address)[0], mode)


def _empty(spec):
    """A batch of no rows matching `spec`, or None where none can be made."""
    import tensorflow as tf

    if not isinstance(spec, tf.TensorSpec) or not spec.shape.rank:
        return None
    return tf.zeros([0] + [d or 0 for d in spec.shape.as_list()[1:]], spec.dtype)


class Service:
    """A dispatcher's address and mode; `bound(comm)` shares a run id (collective)."""

    def __init__(self, address, mode="exact", run_id=None):
        self.address, self.mode, self.run_id = address, mode, run_id
        self._passes = itertools.count()

    def bound(self, comm):
        """This service with a run id drawn on rank 0 and shared by every rank; a
        dispatcher rank 0 cannot reach is a ValueError on every rank (collective)."""
        found = None
        if comm.rank == 0:
            try:
                probe(self.address)
                found = uuid.uuid4().hex[:12]
            except ConnectionError as error:
                found = error
        found = comm.bcast_obj(found, 0)
        if isinstance(found, BaseException):
            raise ValueError(str(found))
        return Service(self.address, self.mode, found)

    def describe(self):
        return f"the tf.data service at {self.address} ({self.mode} mode)"

    def distribute(self, part, replica=None, epoch=None):
        """`part` produced by the service's workers: replica `replica`'s job for the
        pass beginning in `epoch`; None (a whole dataset read on one rank, once per
        epoch by Keras's iterator): a job of its own for each iteration."""
        import tensorflow as tf

        name = None
        if replica is not None:   # (a whole dataset: `bound` probed it just before)
            probe(self.address)
            name = f"hyparflow-{self.run_id}-r{replica}-e{epoch}-p{next(self._passes)}"
        dynamic = tf.data.experimental.service.ShardingPolicy.DYNAMIC
        if self.mode == "dynamic":
            return part.apply(tf.data.experimental.service.distribute(
                processing_mode=dynamic, service=self.address, job_name=name))
        empty = tf.nest.map_structure(_empty, part.element_spec)
        checked = all(e is not None for e in tf.nest.flatten(empty))
        marked = part.map(_marked)
        if checked:   # the worker's last element says the part ended there
            marked = marked.concatenate(tf.data.Dataset.from_tensors((_END, empty)))
        # One split: the one worker that takes it produces the whole part, in order.
        whole = tf.data.Dataset.range(1).flat_map(lambda _: marked).with_options(
            part.options())
        stream = whole.apply(tf.data.experimental.service.distribute(
            processing_mode=dynamic, service=self.address, job_name=name))
        if not checked:
            return stream.map(_value)
        what = (f"replica {replica}'s part for epoch {epoch}" if replica is not None
                else "the dataset")
        message = (f"The stream of {what} from {self.describe()} (job {name}) ended "
                   "before the part's end: its worker was lost, and the dispatcher gives "
                   "a part out once. Restart the workers and resume from a checkpoint.")

        def step(seen, element):
            flag, value = element
            seen = tf.logical_or(seen, tf.equal(flag, _END))
            ok = tf.logical_or(seen, tf.not_equal(flag, _TAIL))
            with tf.control_dependencies([tf.debugging.Assert(ok, [message])]):
                flag = tf.identity(flag)
            return seen, (flag, value)

        tail = tf.data.Dataset.from_tensors((_TAIL, empty))
        return stream.concatenate(tail).scan(tf.constant(False), step).filter(_batch).map(
            _value)

    def bounded(self, batches, what):
        """`batches` (an iterator), each next one awaited at most
        HYPARFLOW_DATA_SERVICE_TIMEOUT seconds: TensorFlow's reader waits without end
        for a lost worker's task, and this rank's peers would see only a silent one."""
        return _Bounded(batches, settings.data_service_timeout(),
                        f"No batch of {what} came from {self.describe()} in {{seconds:.0f}} "
                        "s (HYPARFLOW_DATA_SERVICE_TIMEOUT): the worker producing it was "
                        "lost (the dispatcher gives a part out once, never its rest to "
                        "another worker), or no worker runs. Restart the workers and resume "
                        "from a checkpoint.")


def _marked(*element):
    return _BATCH, element if len(element) > 1 else element[0]


def _batch(flag, value):
    import tensorflow as tf

    return tf.equal(flag, _BATCH)


def _value(flag, value):
    return value


class _Bounded:
    """An iterator whose every `next` waits at most `seconds` (None: without end), on a
    thread of its own: a longer wait raises TimeoutError with `message`."""

    def __init__(self, batches, seconds, message):
        self.batches, self.seconds, self.message = batches, seconds, message

    def __iter__(self):
        return self

    def __next__(self):
        box = []

        def pull():
            try:
                box.append((True, next(self.batches)))
            except BaseException as error:  # noqa: BLE001 - handed to the reader
                box.append((False, error))

        worker = threading.Thread(target=pull, daemon=True, name="hyparflow-data-service")
        worker.start()
        worker.join(self.seconds)
        if not box:
            raise TimeoutError(self.message.format(seconds=self.seconds))
        ok, value = box[0]
        if not ok:
            raise value
        return value
