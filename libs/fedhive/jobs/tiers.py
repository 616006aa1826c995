"""Where a job sits in a hierarchy of fedhive systems (seed 004), and what a hub site needs of
the upper tier's job.

A job a hub site created in a lower tier carries `meta.json` `"hierarchy": {"tier": N,
"parent_job_id": ID, "hub_site": NAME}` (the root system's jobs have none: tier 1), shown by
`fedhive job`. Every site bundle the runner deploys holds `OPERATORS_FILE`: the job's name, its
tier and its server config's `operators` with the components they name: a hub site turns them
into the lower-tier job's server app; other sites ignore it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fedhive.jobs.operators import COMPONENT_FIELDS
from fedhive.jobs.record import JobMeta

if TYPE_CHECKING:  # `fedhive job` shows a job's tier without loading the job formats
    from fedhive.jobs.definition import JobDefinition

OPERATORS_FILE = "config/operators.json"
HIERARCHY = "hierarchy"


def hierarchy_meta(tier: int, parent_job_id: str, hub_site: str) -> dict[str, Any]:
    return {HIERARCHY: {"tier": tier, "parent_job_id": parent_job_id, "hub_site": hub_site}}


def tier_of(meta: JobMeta) -> int:
    """The job's tier: 1 for a job submitted to this system directly."""
    entry = meta.extra.get(HIERARCHY)
    tier = entry.get("tier") if isinstance(entry, dict) else None
    return tier if isinstance(tier, int) and not isinstance(tier, bool) and tier > 1 else 1


def operators_file(definition: JobDefinition) -> bytes:
    """`OPERATORS_FILE` for the job's site bundles."""
    server = definition.configs.get(definition.server_app)
    config = (server.server if server is not None else None) or {}
    operators = config.get("operators") or {}
    named = {desc.get(name) for desc in operators.values() if isinstance(desc, dict)
             for name in COMPONENT_FIELDS}
    components = [c for c in config.get("components", [])
                  if isinstance(c, dict) and c.get("id") in named]
    return json.dumps({"name": definition.meta.name, "tier": tier_of(definition.meta),
                       "operators": operators, "components": components}, indent=1).encode()
