"""`fedhive poc`: the whole system on one machine, for trying fedhive (like FLARE's POC mode).

* `start.start_poc(options, settings)`: RabbitMQ and Redis checked (started, installed when
  local), an embedded S3 server, per-site broker users, site folders, an admin, then the
  services and site agents as detached processes; waits until the sites are online.
* `status.poc_status(layout)`: each process alive or not, each site online or not.
* `stop.stop_poc(layout, settings, ctl)`: stops every process it started (and their
  children), deletes the broker users.

Files: `layout` (the POC folder), `state` (the state file), `procs` (detached processes),
`infra` (RabbitMQ, Redis), `s3server` (SeaweedFS), `services` (the services' command lines,
environment and files), `probes` (readiness), `checks` (before anything starts), `demo` (the
two example jobs end to end).
"""
