"""Connections to RabbitMQ: parameters from the settings URL (and, for `amqps://`, its CA file),
connecting with backoff, and the lock-guarded connection that publishers and RPC clients share
between threads.

pika's `BlockingConnection` is not thread-safe and only does I/O (heartbeats included) inside
its own calls. `GuardedConnection` serialises every use behind one lock and runs a small
keep-alive thread that services the connection while nobody else does, so heartbeats flow on
an idle publisher too. A thread may hold the lock for long to wait for deliveries (an RPC
caller waiting for its reply); one that needs the connection meanwhile takes it through `held()`,
which wakes the waiting one, and `acquire_after_others()` lets such threads go first.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pika
import pika.exceptions
import structlog

from fedhive.bus import pika_io  # noqa: F401  (pika's socket I/O, tuned: see the module)
from fedhive.errors import ConfigError, Unavailable
from fedhive.retry import Backoff

log = structlog.get_logger()

# Errors after which the connection (or its channel) is gone but a new one may work.
CONNECTION_LOST: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.ChannelWrongStateError,
    pika.exceptions.ChannelClosedByClient,
    pika.exceptions.ConsumerCancelled,
    ConnectionError,
)

DEFAULT_HEARTBEAT = 30  # seconds; handlers run off the I/O thread, so no need to tolerate them

# pika's ValueError when the broker closed the socket between its connect and the transport's
# set-up (a broker shutting down or restarting): a failed attempt like any other.
_RESET_WHILE_CONNECTING = "Expected connected socket, but getpeername() failed"
RECONNECT = Backoff(base=0.2, cap=5.0, max_attempts=None, deadline=None)


def connection_parameters(
    amqp_url: str, *, name: str, ca_file: str | None = None, heartbeat: int = DEFAULT_HEARTBEAT
) -> pika.URLParameters:
    """`amqp://` or `amqps://` URL to pika parameters.

    An `amqps://` URL verifies the broker's certificate against `ca_file` (the PEM of the CA
    that signs it: `Settings.amqp_ca_file`) or, without one, the system's CAs (Amazon MQ,
    CloudAMQP), and checks that it names the URL's host. That is the only way to set TLS: pika's
    `?ssl_options=` in the URL is refused, so no URL can turn verification off.
    """
    params = url_parameters(amqp_url)
    if params.ssl_options is not None:
        params.ssl_options = pika.SSLOptions(tls_context(ca_file), server_hostname=params.host)
    params.heartbeat = heartbeat
    params.client_properties = {"connection_name": name}
    return params


def url_parameters(amqp_url: str) -> pika.URLParameters:
    """pika's parse of the URL, once it is known to carry no `?ssl_options=` (which pika would
    act on while parsing: load files, build a context)."""
    if "ssl_options" in parse_qs(urlsplit(amqp_url).query):
        raise ConfigError("the broker URL may not carry ?ssl_options=: an amqps:// URL verifies "
                          "the broker against the CA file (FEDHIVE_AMQP_CA_FILE, a site's "
                          "broker_ca_file) or the system's CAs", field="amqp_url")
    return pika.URLParameters(amqp_url)


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """A client context that verifies the server's certificate and host name (the defaults of
    `create_default_context`), trusting `ca_file` alone when given."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except OSError as err:
        reason = (f"not a PEM CA certificate ({err.reason})" if isinstance(err, ssl.SSLError)
                  else err.strerror)
        raise ConfigError(f"broker CA file {ca_file!r}: {reason}", field="amqp_ca_file") from None


def user_name(params: pika.URLParameters) -> str:
    """The broker user of these parameters: the only value RabbitMQ accepts as `user_id`."""
    return str(params.credentials.username)


def connect(
    params: pika.URLParameters, backoff: Backoff, *, stop: threading.Event | None = None
) -> pika.BlockingConnection:
    """Open a connection, retrying transient failures per `backoff`; `Unavailable` when spent.

    A TLS failure that retrying cannot heal (a certificate the CA file does not vouch for or
    that names another host, a port that does not speak TLS) raises `ConfigError` at once: it
    is the deployment's to fix, and a process that retried forever would only hide it.
    """
    delays = backoff.delays()
    while True:
        try:
            return pika.BlockingConnection(params)
        except (pika.exceptions.AMQPConnectionError, OSError, ValueError) as err:
            if not isinstance(err, pika.exceptions.AMQPConnectionError | OSError) \
                    and not str(err).startswith(_RESET_WHILE_CONNECTING):
                raise  # a ValueError of another kind (ssl's verification errors are OSErrors)
            if (refusal := _tls_refusal(err)) is not None:
                raise ConfigError(f"RabbitMQ at {params.host}:{params.port}: {refusal}",
                                  field="amqp_url") from None
            wait = next(delays, None)
            if wait is None or (stop is not None and stop.is_set()):
                raise Unavailable(
                    f"RabbitMQ at {params.host}:{params.port} is unreachable: {err!r}",
                    field="amqp_url",
                ) from err
            log.warning("bus.connect_retry", host=params.host, wait=round(wait, 2), error=repr(err))
            if stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)


def call_threadsafe(connection: pika.BlockingConnection, callback: Callable[[], None]) -> None:
    """Run `callback` on the thread that services the connection (call from any thread); if
    the connection is closed, nothing (a consumer's unacked message is then redelivered)."""
    with contextlib.suppress(pika.exceptions.ConnectionWrongStateError):
        connection.add_callback_threadsafe(callback)


def wake(connection: pika.BlockingConnection) -> None:
    """Make the thread waiting in the connection's `process_data_events` return."""
    call_threadsafe(connection, _nothing)


def _nothing() -> None:
    """A callback whose only effect is that `process_data_events` returns."""


def _tls_refusal(err: BaseException) -> str | None:
    """Why the TLS handshake failed for good, or None (a failure that a retry may get past)."""
    if isinstance(err, ssl.SSLCertVerificationError):
        return (f"its TLS certificate is refused ({err.verify_message}): check the CA file "
                "(FEDHIVE_AMQP_CA_FILE, a site's broker_ca_file; unset: the system's CAs) and "
                "that the URL's host is a name on the certificate")
    if isinstance(err, ssl.SSLError) and err.reason == "WRONG_VERSION_NUMBER":
        return "it does not speak TLS on this port (an amqps:// URL needs the broker's TLS port)"
    return None


class GuardedConnection:
    """One connection and one channel, used by many threads one at a time.

    Callers hold `lock` around `channel()` and everything they do with it; on a
    `CONNECTION_LOST` error they call `reset()` and try again.
    """

    def __init__(
        self,
        params: pika.URLParameters,
        setup: Callable[[Any], None],
        *,
        backoff: Backoff = RECONNECT,
    ) -> None:
        self.lock = threading.RLock()
        self._wanted = 0  # threads waiting in `held()`; guarded by _turns
        self._turns = threading.Condition()
        self._params = params
        self._setup = setup
        self._backoff = backoff
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None
        self._closed = threading.Event()
        name = params.client_properties["connection_name"]
        self._keepalive = threading.Thread(
            target=self._keep_alive, name=f"bus-keepalive-{name}", daemon=True
        )
        self._keepalive.start()

    def channel(self) -> Any:
        """The open channel, (re)connecting first if needed. Call with `lock` held."""
        if self._closed.is_set():
            raise Unavailable("the bus connection is closed", field="amqp_url")
        if self._channel is None or not self._channel.is_open:
            self.reset()
            self._connection = connect(self._params, self._backoff, stop=self._closed)
            self._channel = self._connection.channel()
            self._setup(self._channel)
        return self._channel

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def connection(self) -> pika.BlockingConnection | None:
        return self._connection

    def reset(self) -> None:
        """Drop the current connection (after an error); the next `channel()` reconnects."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(*CONNECTION_LOST):
                connection.close()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """`lock`, taken soon: a thread holding it to wait for deliveries is woken to let go."""
        with self._turns:
            self._wanted += 1
        try:
            if not self.lock.acquire(blocking=False):
                connection = self._connection
                if connection is not None:
                    wake(connection)
                self.lock.acquire()
        finally:
            with self._turns:
                self._wanted -= 1
                self._turns.notify_all()
        try:
            yield
        finally:
            self.lock.release()

    def acquire_after_others(self, timeout: float) -> bool:
        """Take `lock` to wait for deliveries, once every thread waiting in `held()` had it
        (else a waiting thread woken to let go could take it straight back); False after
        `timeout`."""
        deadline = time.monotonic() + timeout
        with self._turns:
            if not self._turns.wait_for(lambda: self._wanted == 0, timeout):
                return False
        return self.lock.acquire(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._closed.set()
        with self.held():
            self.reset()
        self._keepalive.join()

    def _keep_alive(self) -> None:
        interval = max(1.0, (self._params.heartbeat or DEFAULT_HEARTBEAT) / 4)
        while not self._closed.wait(interval):
            if not self.lock.acquire(blocking=False):
                continue  # in use: whoever holds it services the connection
            try:
                if self._connection is not None and self._connection.is_open:
                    self._connection.process_data_events(time_limit=0)
            except CONNECTION_LOST as err:
                log.info("bus.connection_lost", where="keepalive", error=repr(err))
                self.reset()
            finally:
                self.lock.release()
