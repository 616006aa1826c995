"""fedhive.bus: RabbitMQ messaging: confirmed publishing, consumers, RPC and events.

Domain code and handlers see the `Bus` port (`fedhive.bus.port`); a composition root builds
the adapter, `RabbitBus(settings, name=...)`, and closes it on shutdown. `MemoryBus` on a
`MemoryBroker` (`fedhive.bus.memory`) is the same port inside one process (`fedhive simulate`,
fast tests).

Threading model (pika is not thread-safe; every connection is used by one thread at a time):

* Each consumer (`serve`, `subscribe`) has its own thread and its own `BlockingConnection`.
  That thread only does AMQP I/O; handlers run on the consumer's own small thread pool
  (`concurrency`, default 1), and their outcomes come back through
  `connection.add_callback_threadsafe`. The connection thread keeps servicing heartbeats
  however long a handler runs, so no heartbeat setting has to tolerate handler time.
* The publisher and the RPC client each own one connection guarded by a lock, so any thread
  may publish or call. RPC callers share the connection: whoever waits services it in short
  slices and delivers every reply by correlation id, so concurrent calls do not queue behind a
  slow one. A keep-alive thread services idle connections so heartbeats keep flowing.
* `subscribe_batches` (heartbeats): one thread and connection per consumer, handling whole
  batches on that thread and acking each batch with one frame, for rates where a handler
  thread per message would cost more than the work.
* `Consumer.stop()` / `RabbitBus.close()`: stop consuming, let running handlers finish and
  ack, close connections, join threads. Prefetched messages not yet started are redelivered.

Delivery guarantees: publishes wait for the broker's confirm and are re-sent after a
reconnect (at-least-once: deduplicate by `message_id`); consumers ack only after the handler
returned; failures are dead-lettered, never looped (see `fedhive.bus.delivery`).
"""

from fedhive.bus.batch import Batch, BatchConsumer, BatchHandler
from fedhive.bus.codec import Encoded, TypeRegistry
from fedhive.bus.consumer import Consumer
from fedhive.bus.delivery import Delivery, Handler, Pending
from fedhive.bus.memory import MemoryBus
from fedhive.bus.memory_broker import MemoryBroker
from fedhive.bus.port import Bus, Subscription
from fedhive.bus.rabbitmq import RabbitBus
from fedhive.bus.senders import Senders
from fedhive.bus.topology import QueueSpec, Topology

__all__ = [
    "Batch",
    "BatchConsumer",
    "BatchHandler",
    "Bus",
    "Consumer",
    "Delivery",
    "Encoded",
    "Handler",
    "MemoryBroker",
    "MemoryBus",
    "Pending",
    "QueueSpec",
    "RabbitBus",
    "Senders",
    "Subscription",
    "Topology",
    "TypeRegistry",
]
