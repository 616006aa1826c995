"""A job's logs, shared while it runs: `fedhive logs JOB`.

* `lines`: one line as it is shared: clipped (`MAX_LINE_BYTES`) and told apart as an error
  (a structlog JSON line of level error/critical, or the last line of a Python traceback).
* `tail`: new lines of a growing log file from a saved `Position`, in batches of at most
  `MAX_BATCH_BYTES`; a file that grows faster than it is shared is skipped ahead (one marker
  line says how much).
* `wire`: the `LogBatch` a site agent publishes on `site.<site>.logs`, and the `LogEntry` the
  SDK hands out.

Who does what: a site agent tails each of its client jobs' log files (`<workspace>/.agent/jobs/
<job>.log`: the client job's and its trainer's stdout and stderr) and publishes batches to the
job-runner, which verifies the sender (the broker's user_id is the site's) and that the job was
deployed to that site before it stores them (`fedhive.state.joblogs`); the runner tails its own
server jobs' `server_job.log` into the same store. The job-store reads them for the gateway's
`JobLogs`. Pure Python, no transport: the site agent imports it at start.
"""
