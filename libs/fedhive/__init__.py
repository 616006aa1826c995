"""fedhive: a federated-learning job system built as message-queue-driven microservices."""

__version__ = "0.1.0"
