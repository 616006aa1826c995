"""Every queue, exchange, Redis key and S3 key name in fedhive, from one set of templates.

All names start with the namespace so several deployments (and every test) can share one
broker, one Redis and one bucket.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Names:
    ns: str

    # RabbitMQ -----------------------------------------------------------------------------
    @property
    def cmd_exchange(self) -> str:
        return f"{self.ns}.cmd"

    @property
    def events_exchange(self) -> str:
        return f"{self.ns}.events"

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.ns}.dlx"

    @property
    def replies_exchange(self) -> str:
        """Topic exchange of RPC replies to the services' reply queues (`reply_queue`): sites
        may not publish to the default exchange, so their replies come this way."""
        return f"{self.ns}.replies"

    def reply_queue(self, tag: str) -> str:
        """A services RPC client's exclusive reply queue, bound to `replies_exchange` by its
        own name."""
        return f"{self.ns}.reply.{tag}"

    def service_queue(self, service: str) -> str:
        """`job-store`, `scheduler`, `job-runner`."""
        return f"{self.ns}.{service}"

    def site_queue(self, site: str) -> str:
        return f"{self.ns}.site.{site}"

    def site_of_queue(self, queue: str) -> str | None:
        """The site whose control queue `queue` is; None for any other queue."""
        prefix = self.site_queue("")
        site = queue[len(prefix):] if queue.startswith(prefix) else ""
        return site if site and "." not in site else None

    def job_server_queue(self, job_id: str) -> str:
        return f"{self.ns}.job.{job_id}.server"

    def job_site_route(self, job_id: str, site: str) -> str:
        """The routing key a site's task traffic to a job's server queue uses: the server job
        binds it for each site of the job only, and a site's broker user may publish with no
        other (`fedhive.brokerusers`), so a site reaches exactly the jobs it runs."""
        return f"{self.job_server_queue(job_id)}.{site}"

    # Broker users ---------------------------------------------------------------------------
    def site_user(self, site: str) -> str:
        """A site's broker user: the namespace is part of it, so two deployments (or tenants)
        on one broker with the same site names never share a user."""
        return f"{self.ns}.{site}"

    def site_of_user(self, user: str | None) -> str | None:
        """The site whose broker user `user` is, in this namespace; None for any other user."""
        prefix = f"{self.ns}."
        if user is None or not user.startswith(prefix) or len(user) == len(prefix):
            return None
        site = user[len(prefix):]
        return None if "." in site else site

    def events_queue(self, consumer: str) -> str:
        """The queue a service binds to the events exchange."""
        return f"{self.ns}.events.{consumer}"

    @staticmethod
    def dead_letter_queue(queue: str) -> str:
        return f"{queue}.dlq"

    # Event routing keys (events exchange) ----------------------------------------------------
    # What a site publishes starts with `site.<site>.`, so per-site broker topic permissions
    # can allow exactly `^site\.<user>\.`; what the registry derives from them is `site.online`
    # and `site.offline` (two words), which no site may publish.
    @staticmethod
    def site_event(site: str, kind: str) -> str:
        """`kind`: `heartbeat` (periodic SiteHeartbeat), `online` (agent started), `offline`
        (clean shutdown), `job` (a running client job's JobHeartbeat), `logs` (a LogBatch of
        a client job's log lines: `fedhive.joblogs`)."""
        return f"site.{site}.{kind}"

    SITE_ONLINE = "site.online"  # published by the heartbeat intake on a registry transition
    SITE_OFFLINE = "site.offline"

    @staticmethod
    def job_status_event(status: str) -> str:
        return f"job.status.{status}"

    JOB_ROUND_COMPLETED = "job.round.completed"  # a server job's workflow finished a round

    # Redis ----------------------------------------------------------------------------------
    # Every key starts with a hash tag (the part in braces), which decides its Redis Cluster
    # slot. Two kinds of slot (DESIGN.md §4):
    # * the namespace slot `{ns}`: job records and histories, the status indexes, sites,
    #   leases and fences, the runs table, idempotency keys: what the atomic scripts combine;
    # * a job's slot `{ns:job:<id>}`: the job's own bulky data that no script combines with the
    #   namespace keys (rounds, logs, heartbeats, server-job records) and `job_live_key`, so
    #   jobs spread over a cluster's shards.
    # The layout is the same on a standalone Redis.
    @property
    def redis_patterns(self) -> tuple[str, str]:
        """SCAN patterns that together match every Redis key of the namespace."""
        return f"{{{self.ns}}}:*", f"{{{self.ns}:job:*"

    def key(self, *parts: str) -> str:
        """A key in the namespace slot."""
        return ":".join((f"{{{self.ns}}}", *parts))

    def job_data_key(self, job_id: str, *parts: str) -> str:
        """A key in the job's own slot."""
        return ":".join((f"{{{self.ns}:job:{job_id}}}", *parts))

    def job_key(self, job_id: str) -> str:
        return self.key("job", job_id)

    def job_history_key(self, job_id: str) -> str:
        return self.key("job", job_id, "history")

    @property
    def jobs_by_submit_key(self) -> str:
        return self.key("jobs", "by-submit")

    def jobs_by_status_key(self, status: str) -> str:
        return self.key("jobs", "by-status", status)

    def site_key(self, site: str) -> str:
        return self.key("site", site)

    @property
    def sites_key(self) -> str:
        return self.key("sites")

    @property
    def sites_online_key(self) -> str:
        """Set of the sites the registry last announced online (so transitions survive restarts
        and only one intake replica announces each one)."""
        return self.key("sites", "online")

    @property
    def sites_last_key(self) -> str:
        """Hash site -> the site's last heartbeat (JSON), kept after the live record expires."""
        return self.key("sites", "last")

    def job_live_key(self, job_id: str) -> str:
        """Exists from just before the job's record is created until the job is deleted: what
        the scripts in the job's slot check instead of the record (`fedhive.state.joblogs`)."""
        return self.job_data_key(job_id, "live")

    def job_rounds_key(self, job_id: str) -> str:
        """List of the rounds a job's workflows reported (JSON, oldest first; `RoundLog`),
        readable while the job runs; deleted with the job."""
        return self.job_data_key(job_id, "rounds")

    def job_logs_key(self, job_id: str) -> str:
        """Stream of a job's log lines (fields site, source, line), capped; deleted with the job
        (`fedhive.state.joblogs`)."""
        return self.job_data_key(job_id, "logs")

    def job_log_errors_key(self, job_id: str) -> str:
        """Hash site -> the last error line of that site's (or the server job's) log."""
        return self.job_data_key(job_id, "logs", "errors")

    def job_log_seen_key(self, job_id: str) -> str:
        """Hash site -> the byte ranges of its log file already stored (deduplication)."""
        return self.job_data_key(job_id, "logs", "seen")

    def job_log_sites_key(self, job_id: str) -> str:
        """Hash site -> `done` (its last line is in) or `private` (it does not share logs)."""
        return self.job_data_key(job_id, "logs", "sites")

    def job_log_keys(self, job_id: str) -> list[str]:
        """Every key of a job's logs (deleted with the job)."""
        return [self.job_logs_key(job_id), self.job_log_errors_key(job_id),
                self.job_log_seen_key(job_id), self.job_log_sites_key(job_id)]

    def job_heartbeat_key(self, job_id: str, site: str) -> str:
        return self.job_data_key(job_id, "beat", site)

    @property
    def runs_key(self) -> str:
        """Hash job_id -> the job-runner's entry for a job it dispatched and not yet finished
        (the running-jobs table, read back by a restarted runner to re-attach)."""
        return self.key("runs")

    def server_job_alive_key(self, job_id: str) -> str:
        """The server-job process's liveness record (expires unless the SJ renews it)."""
        return self.job_data_key(job_id, "sj", "alive")

    def server_job_stop_key(self, job_id: str) -> str:
        """Set by a runner that must stop an SJ it cannot signal (on another host); the SJ
        looks at it with each liveness renewal."""
        return self.job_data_key(job_id, "sj", "stop")

    def server_job_outcome_key(self, job_id: str) -> str:
        """What the server-job process reported when it ended (first report wins)."""
        return self.job_data_key(job_id, "sj", "outcome")

    def lease_key(self, name: str) -> str:
        return self.key("lease", name)

    def fence_key(self, name: str) -> str:
        return self.key("fence", name)

    def idempotency_key(self, scope: str, message_id: str) -> str:
        return self.key("idem", scope, message_id)

    # S3 -------------------------------------------------------------------------------------
    def job_prefix(self, job_id: str) -> str:
        """Everything S3 holds for one job; deleting the job deletes this prefix."""
        return f"{self.ns}/jobs/{job_id}/"

    def job_definition_key(self, job_id: str) -> str:
        return f"{self.job_prefix(job_id)}definition.zip"

    def job_result_key(self, job_id: str) -> str:
        return f"{self.job_prefix(job_id)}result.zip"

    def job_bundle_key(self, job_id: str, app: str) -> str:
        """An app of the job, zipped for the sites it is deployed to."""
        return f"{self.job_prefix(job_id)}bundles/{app}.zip"

    def job_tensor_prefix(self, job_id: str) -> str:
        """A job's tensor objects (task data, results, checkpoints), deleted with the job."""
        return f"{self.job_prefix(job_id)}tensors/"

    def job_checkpoint_key(self, job_id: str) -> str:
        """The job's last completed round: global model refs and round number (resume)."""
        return f"{self.job_prefix(job_id)}checkpoint.pb"

    def staging_key(self, upload_id: str) -> str:
        """Where the gateway stages an uploaded archive before the job-store accepts it."""
        return f"{self.ns}/staging/{upload_id}.zip"

    def tensor_prefix(self, scope: str) -> str:
        """Where a job's (or a test's) tensor objects live: `{ns}/tensors/{scope}/`."""
        return f"{self.ns}/tensors/{scope}/"
