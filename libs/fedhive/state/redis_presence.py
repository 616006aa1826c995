"""Sites in Redis: each site's last heartbeat (a key with the site TTL), the presence sets
whose transitions (online, offline, swept) are decided in Lua (`fedhive.state.presence_scripts`),
and the client jobs' beats, each job's in its own slot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, cast

from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.sites.serde import site_heartbeat_from_dict, site_heartbeat_to_dict
from fedhive.state import presence_scripts
from fedhive.state.redis_base import RedisBase, ms


class RedisPresence(RedisBase):
    """Implements `fedhive.state.port.SitePresence`."""

    # sites ----------------------------------------------------------------------------------
    def record_heartbeat(self, beat: SiteHeartbeat, ttl_s: float) -> None:
        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            value = json.dumps(site_heartbeat_to_dict(beat))
            pipe.set(self._names.site_key(beat.site), value, px=ms(ttl_s))
            pipe.zadd(self._names.sites_key, {beat.site: beat.sent_at_ms})
            pipe.execute()

        self._call(f"record heartbeat of site {beat.site}", write)

    def get_site(self, site: str) -> SiteHeartbeat | None:
        key = self._names.site_key(site)
        raw = cast(str | None, self._call(f"read site {site}", lambda: self._client.get(key)))
        return None if raw is None else site_heartbeat_from_dict(json.loads(raw))

    def known_sites(self) -> list[str]:
        key = self._names.sites_key
        sites = cast(list[str], self._call("list sites", lambda: self._client.zrange(key, 0, -1)))
        return sorted(sites)

    def live_sites(self) -> list[SiteHeartbeat]:
        sites = self.known_sites()
        if not sites:
            return []
        keys = [self._names.site_key(site) for site in sites]
        raws = cast(list[str | None], self._call("read sites", lambda: self._client.mget(keys)))
        return [site_heartbeat_from_dict(json.loads(raw)) for raw in raws if raw is not None]

    # site presence (transitions decided in Lua, see fedhive.state.presence_scripts) ---------
    def _presence_keys(self) -> list[str]:
        n = self._names
        return [n.sites_key, n.sites_online_key, n.sites_last_key]

    def record_heartbeats(self, beats: Sequence[SiteHeartbeat], ttl_s: float) -> list[str]:
        if not beats:
            return []
        keys = [*self._presence_keys(), *(self._names.site_key(b.site) for b in beats)]
        args: list[Any] = [ms(ttl_s)]
        for beat in beats:
            args += [beat.site, beat.sent_at_ms, json.dumps(site_heartbeat_to_dict(beat))]
        what = f"record {len(beats)} heartbeats"
        return cast(list[str], self._script(what, presence_scripts.RECORD_HEARTBEATS, keys, args))

    def mark_offline(self, beat: SiteHeartbeat) -> bool:
        keys = [*self._presence_keys(), self._names.site_key(beat.site)]
        args = [beat.site, beat.sent_at_ms, json.dumps(site_heartbeat_to_dict(beat))]
        what = f"mark site {beat.site} offline"
        return bool(self._script(what, presence_scripts.MARK_OFFLINE, keys, args) == 1)

    def sweep_expired(self) -> list[SiteHeartbeat]:
        n = self._names
        online = self.online_sites()
        if not online:
            return []
        keys = [n.sites_online_key, n.sites_last_key, *(n.site_key(site) for site in online)]
        reply = self._script("sweep expired sites", presence_scripts.SWEEP_EXPIRED, keys,
                             online)
        return [
            site_heartbeat_from_dict(json.loads(raw)) if raw else SiteHeartbeat(site=site)
            for site, raw in zip(reply[::2], reply[1::2], strict=True)
        ]

    def last_heartbeats(self) -> dict[str, SiteHeartbeat]:
        key = self._names.sites_last_key
        raws = cast(dict[str, str], self._call("read last heartbeats",
                                               lambda: self._client.hgetall(key)))
        return {site: site_heartbeat_from_dict(json.loads(raws[site])) for site in sorted(raws)}

    def online_sites(self) -> list[str]:
        key = self._names.sites_online_key
        return sorted(cast(set[str], self._call("list online sites",
                                                lambda: self._client.smembers(key))))

    def record_job_heartbeats(self, beats: Sequence[JobHeartbeat], ttl_s: float) -> None:
        by_job: dict[str, list[JobHeartbeat]] = {}
        for beat in beats:
            by_job.setdefault(beat.job_id, []).append(beat)
        for job_id, batch in by_job.items():  # one script per job: each job has its own slot
            keys = [self._names.job_heartbeat_key(job_id, beat.site) for beat in batch]
            args: list[Any] = [ms(ttl_s)]
            for beat in batch:
                args += [json.dumps(asdict(beat)), int(beat.ended)]
            self._script(f"record {len(batch)} heartbeats of job {job_id}",
                         presence_scripts.RECORD_JOB_HEARTBEATS, keys, args)

    def get_job_heartbeat(self, job_id: str, site: str) -> JobHeartbeat | None:
        return self.get_job_heartbeats(job_id, [site]).get(site)

    def get_job_heartbeats(self, job_id: str, sites: Sequence[str]) -> dict[str, JobHeartbeat]:
        if not sites:
            return {}
        keys = [self._names.job_heartbeat_key(job_id, site) for site in sites]  # the job's slot
        raws = cast(list[str | None], self._call(f"read job {job_id} heartbeats",
                                                 lambda: self._client.mget(keys)))
        return {site: JobHeartbeat(**json.loads(raw))
                for site, raw in zip(sites, raws, strict=True) if raw is not None}
