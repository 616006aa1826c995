"""Who may send to a queue: its consumer checks a message's AMQP `user_id` before anything else.

RabbitMQ refuses a publish whose `user_id` is not the publishing connection's own user, so the
value names the sender's broker user and cannot be forged; every fedhive bus stamps it on every
message. A message without one is unsigned and never accepted. Broker permissions already keep
a site's user away from every queue but its own job channels (`fedhive.brokerusers`); this check
is the second wall, for a broker whose permissions are wrong or too wide.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhive.names import Names


@dataclass(frozen=True)
class Senders:
    """`users` by name, and with `sites_of` every site user of that namespace."""

    users: frozenset[str] = frozenset()
    sites_of: Names | None = None

    @classmethod
    def only(cls, *users: str) -> Senders:
        return cls(frozenset(users))

    @classmethod
    def any_site(cls, names: Names) -> Senders:
        return cls(sites_of=names)

    def accepts(self, user_id: str | None) -> bool:
        if not user_id:
            return False
        if user_id in self.users:
            return True
        return self.sites_of is not None and self.sites_of.site_of_user(user_id) is not None

    def describe(self) -> str:
        accepted = sorted(self.users)
        if self.sites_of is not None:
            accepted.append(f"any site of namespace {self.sites_of.ns}")
        return ", ".join(accepted) or "nobody"
