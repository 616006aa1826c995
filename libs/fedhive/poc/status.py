"""`poc status`: is each process of the POC alive, and which sites does the gateway list online.

JSON (a stable schema):

    {"dir", "running" (a POC was started there and not stopped), "healthy" (every process
     alive and every site online), "namespace", "gateway", "config" (the CLI config file),
     "s3_endpoint", "embedded_s3", "started_at",
     "processes": [{"name", "pid", "alive", "log"}], "sites": {site: online}}
"""

from __future__ import annotations

import tomllib
from typing import Any

from fedhive.poc import probes, procs
from fedhive.poc.layout import PocLayout
from fedhive.poc.state import load_state


def poc_status(layout: PocLayout) -> dict[str, Any]:
    state = load_state(layout.state_file)
    if state is None:
        return {"dir": str(layout.root), "running": False, "healthy": False, "processes": [],
                "sites": {}}
    processes = [{"name": e.name, "pid": e.pid, "alive": procs.alive(e), "log": e.log}
                 for e in state.processes]
    gateway_alive = any(p["alive"] for p in processes if p["name"] == "gateway")
    token = cli_token(layout)
    online = probes.online_sites(state.gateway, token) if gateway_alive and token else set()
    sites = {site: site in online for site in state.sites}
    return {
        "dir": str(layout.root), "running": True,
        "healthy": all(p["alive"] for p in processes) and all(sites.values()),
        "namespace": state.namespace, "gateway": state.gateway,
        "config": str(layout.cli_config), "s3_endpoint": state.s3_endpoint,
        "embedded_s3": state.embedded_s3, "started_at": state.started_at,
        "processes": processes, "sites": sites,
    }


def cli_token(layout: PocLayout) -> str | None:
    """The POC admin's token, from the CLI config the POC wrote (None if unreadable)."""
    try:
        token = tomllib.loads(layout.cli_config.read_text()).get("token")
    except (OSError, ValueError):
        return None
    return token if isinstance(token, str) else None
