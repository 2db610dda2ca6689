"""Every Redis key name unigate uses, built here and nowhere else, under one prefix.

Per-key state shares the hash tag `{<key id>}` and per-deployment state the tag `{up:<deployment>}`, so each Lua
script only touches keys of one Redis Cluster slot. Scripts that derive a name (a per-day usage hash, a waiter's
wake-up list) build it from a `*_prefix` below, which carries the same tag.

    ug:keyhash:<sha256>              string  → key id (lookup by hash; never the secret)
    ug:keys                          zset    key ids scored by creation time (ms), for listing
    ug:{<id>}:key                    hash    the key record and its lifetime counters
    ug:{<id>}:rpm                    zset    sliding request log: member request id, score admit time (ms)
    ug:{<id>}:tpm                    zset    sliding token log: member "<request id>|<tokens>", score time (ms)
    ug:{<id>}:tpm_sum                string  tokens currently in ug:{<id>}:tpm
    ug:{<id>}:leases                 zset    concurrency leases: member request id, score expiry (ms)
    ug:{<id>}:holds                  zset    budget holds of requests in flight: member "<request id>|<tokens>|
                                             <micros>", score expiry (ms)
    ug:{<id>}:holds_sum              string  what the holds hold in all: "|<tokens>|<micros>" (expires with them)
    ug:{<id>}:settled:<request id>   string  settle idempotency marker
    ug:{<id>}:usage:<YYYY-MM-DD>     hash    "<model>|requests|prompt_tokens|completion_tokens" for one UTC day
    ug:{<id>}:usage_days             zset    days with usage (member date, score day number)
    ug:{<id>}:usage_total            hash    lifetime per-model counters
    ug:teams                         zset    team ids scored by creation sequence, for listing
    ug:{team:<id>}:team              hash    the team record (same limit and counter fields as a key record)
    ug:{team:<id>}:members           set     ids of the team's keys
    ug:{team:<id>}:<rpm|tpm|tpm_sum|leases|holds|holds_sum|settled:<rid>|usage:<day>|usage_days|usage_total>
                                             the team's own state, named as a key's under its tag: every
                                             `key_*(state_id)` below takes `team_state_id(<id>)` = "team:<id>"
    ug:{up:<deployment>}:leases      zset    upstream in-flight leases: member lease id, score expiry (ms)
    ug:{up:<deployment>}:queue       list    FIFO of waiters "<lease id>|<deadline ms>" of gateways before the fair
                                             queue (still served first during a rolling upgrade; no longer added to)
    ug:{up:<deployment>}:tenants:<class>
                                     zset    tenants with waiters in priority class high|normal|low, scored by their
                                             virtual counter (hand-offs / weight); a tenant leaves when its line empties
    ug:{up:<deployment>}:queue:<class>:<tenant>
                                     list    a tenant's waiters in that class "<lease id>|<deadline ms>|<weight>", FIFO
    ug:{up:<deployment>}:max         string  the deployment's max_in_flight, for hand-off on release
    ug:{up:<deployment>}:wake:<id>   list    a waiter's wake-up list (BLPOP)
    ug:{health:<n>}                  string  /health/ready's write probe (expires after a minute); in a cluster
                                             one per primary, n chosen so that its slot lives there
    ug:session:<sha256 of id>        string  a console session: JSON {csrf, fingerprint, created} (expires with it)
    ug:auth:<client ip>              string  console logins and failed master-key checks from one client address in
                                             the current minute (expires after it)
    ug:auth_peer:<peer ip>           string  the same, counted per trusted proxy for the clients it forwards
    ug:{reqlog}:log                  stream  the request log: one entry per finished request (auth/request_log.py)
    ug:{reqlog}:ids:<day>            hash    request id → its entry id in the log, for the requests of one day
                                             (expires a retention after the day ends)
    ug:events                        pubsub  record changes: "<key id>" → drop cached copies of that key, "<team id>"
                                             → of every key of that team (PUBLISH reaches every node of a cluster,
                                             so any node may be subscribed to)
    ug:placements                    pubsub  prefix_affinity moves, [instance, [[model, key hex, deployment], ...]]
                                             (gateway/placement_sync.py)

A key and its team live in different slots: no script touches both (docs/keys-and-limits.md, "Teams": the two
admissions are pipelined together and compensated). The global names (`ug:keys`, `ug:keys:seq`, `ug:teams`,
`ug:teams:seq`, `ug:keyhash:*`) are only ever used one at a time, never together with
another key in one script or transaction, so they need no hash tag and live wherever their slot falls.
"""

from __future__ import annotations

__all__ = [
    "EVENTS_CHANNEL",
    "KEY_INDEX",
    "KEY_SEQUENCE",
    "MASTER_ID",
    "PLACEMENTS_CHANNEL",
    "PREFIX",
    "REQUEST_LOG",
    "TEAM_INDEX",
    "TEAM_SEQUENCE",
    "auth_attempts",
    "auth_attempts_via_peer",
    "health_probe",
    "key_hash_name",
    "key_holds",
    "key_holds_sum",
    "key_leases",
    "key_prefix",
    "key_record",
    "key_rpm_log",
    "key_settled",
    "key_tpm_log",
    "key_tpm_sum",
    "key_usage_day",
    "key_usage_days",
    "key_usage_total",
    "request_log_index",
    "request_log_index_prefix",
    "session",
    "state_record",
    "team_members",
    "team_prefix",
    "team_record",
    "team_state_id",
    "upstream_leases",
    "upstream_line",
    "upstream_max",
    "upstream_prefix",
    "upstream_queue",
    "upstream_tenants",
    "upstream_wake",
]

PREFIX = "ug:"
KEY_INDEX = PREFIX + "keys"
KEY_SEQUENCE = PREFIX + "keys:seq"  # creation counter: the KEY_INDEX score
TEAM_INDEX = PREFIX + "teams"
TEAM_SEQUENCE = PREFIX + "teams:seq"
EVENTS_CHANNEL = PREFIX + "events"
PLACEMENTS_CHANNEL = PREFIX + "placements"  # prefix_affinity's moves between gateway instances
MASTER_ID = "master"  # usage of the master key is recorded under this pseudo id


def health_probe(n: int) -> str:
    return f"{PREFIX}{{health:{n}}}"


def key_hash_name(key_hash: str) -> str:
    return f"{PREFIX}keyhash:{key_hash}"


def key_prefix(key_id: str) -> str:
    return f"{PREFIX}{{{key_id}}}:"


def team_prefix(team_id: str) -> str:
    """A team's state, named like a key's (`key_rpm_log(...)` etc. take a prefix id) under the tag `{team:<id>}`."""
    return f"{PREFIX}{{team:{team_id}}}:"


def team_state_id(team_id: str) -> str:
    """The id a team's own state is named under by the `key_*` functions: `key_rpm_log(team_state_id(t))`."""
    return f"team:{team_id}"


def state_record(state_id: str) -> str:
    """The record whose limits govern a state id: a team's for "team:<id>", else the key's."""
    if state_id.startswith("team:"):
        return team_record(state_id[5:])
    return key_record(state_id)


def team_record(team_id: str) -> str:
    return team_prefix(team_id) + "team"


def team_members(team_id: str) -> str:
    return team_prefix(team_id) + "members"


def key_record(key_id: str) -> str:
    return key_prefix(key_id) + "key"


def key_rpm_log(key_id: str) -> str:
    return key_prefix(key_id) + "rpm"


def key_tpm_log(key_id: str) -> str:
    return key_prefix(key_id) + "tpm"


def key_tpm_sum(key_id: str) -> str:
    return key_prefix(key_id) + "tpm_sum"


def key_leases(key_id: str) -> str:
    return key_prefix(key_id) + "leases"


def key_holds(key_id: str) -> str:
    """Budget reservations of the key's requests in flight (a team can hold the same zset under its own tag)."""
    return key_prefix(key_id) + "holds"


def key_holds_sum(key_id: str) -> str:
    """What the key's holds hold in all ("|<tokens>|<micros>"), kept with them by the scripts."""
    return key_prefix(key_id) + "holds_sum"


def key_settled(key_id: str, request_id: str) -> str:
    return key_prefix(key_id) + f"settled:{request_id}"


def key_usage_day(key_id: str, day: str) -> str:
    return key_prefix(key_id) + f"usage:{day}"


def key_usage_days(key_id: str) -> str:
    return key_prefix(key_id) + "usage_days"


def key_usage_total(key_id: str) -> str:
    return key_prefix(key_id) + "usage_total"


def session(session_hash: str) -> str:
    return f"{PREFIX}session:{session_hash}"


def auth_attempts(client: str) -> str:
    return f"{PREFIX}auth:{client}"


def auth_attempts_via_peer(peer: str) -> str:
    return f"{PREFIX}auth_peer:{peer}"


def upstream_prefix(deployment: str) -> str:
    # Braces inside the name would end the hash tag early and split one deployment's keys across slots.
    safe = deployment.replace("{", "(").replace("}", ")")
    return f"{PREFIX}{{up:{safe}}}:"


def upstream_leases(deployment: str) -> str:
    return upstream_prefix(deployment) + "leases"


def upstream_queue(deployment: str) -> str:
    return upstream_prefix(deployment) + "queue"


def upstream_max(deployment: str) -> str:
    return upstream_prefix(deployment) + "max"


def upstream_tenants(deployment: str, priority: str) -> str:
    """The tenants with waiters in one priority class, scored by virtual counter (the scripts derive nothing here:
    all three are declared keys)."""
    return upstream_prefix(deployment) + f"tenants:{priority}"


def upstream_line(deployment: str, priority: str, tenant: str) -> str:
    """One tenant's waiters in one priority class (the hand-off derives the same name from `upstream_prefix`)."""
    return upstream_prefix(deployment) + f"queue:{priority}:{tenant}"


def upstream_wake(deployment: str, lease_id: str) -> str:
    return upstream_prefix(deployment) + f"wake:{lease_id}"


REQUEST_LOG = PREFIX + "{reqlog}:log"  # the request log's stream (auth/request_log.py)


def request_log_index_prefix() -> str:
    """`ug:{reqlog}:ids:`: one hash a day (UTC), request id -> its entry id in REQUEST_LOG (same tag: the append
    script derives these)."""
    return PREFIX + "{reqlog}:ids:"


def request_log_index(day: int) -> str:
    """The index of the requests logged on `day` (days since the epoch, by the writing gateway's clock)."""
    return request_log_index_prefix() + str(day)
