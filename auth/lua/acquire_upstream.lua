-- acquire_upstream: take one of a deployment's cluster-wide max_in_flight slots, or wait in its tenant's line.
--
-- KEYS[1]  ug:{up:<d>}:leases               zset    in-flight leases: member lease id, score expiry (ms)
-- KEYS[2]  ug:{up:<d>}:queue                list    waiters of gateways before the fair queue: "<lease id>|<deadline
--                                                    ms>", oldest first (served first, never added to any more)
-- KEYS[3]  ug:{up:<d>}:max                  string  max_in_flight, kept for release_upstream's hand-off
-- KEYS[4]  ug:{up:<d>}:tenants:high         zset    tenants with waiters in the class: member tenant, score its
-- KEYS[5]  ug:{up:<d>}:tenants:normal                virtual counter (hand-offs / weight; a tenant joins at the
-- KEYS[6]  ug:{up:<d>}:tenants:low                   class's minimum, so time without waiters banks no credit)
-- KEYS[7]  ug:{up:<d>}:queue:<class>:<tenant>  list  this waiter's line: "<lease id>|<deadline ms>|<weight>", FIFO
-- ARGV[1]  lease id (also the waiter id)
-- ARGV[2]  max_in_flight
-- ARGV[3]  lease ttl (ms): a crashed holder's slot frees itself after this
-- ARGV[4]  wait timeout (ms): a queued waiter that has not come back by then is skipped
-- ARGV[5]  this waiter's queue entry from an earlier call ("" on the first call)
-- ARGV[6]  the deployment's name prefix "ug:{up:<d>}:" (other tenants' lines and wake lists share its slot)
-- ARGV[7]  priority class: high | normal | low
-- ARGV[8]  tenant
-- ARGV[9]  weight (> 0)
-- ARGV[10] hand-off ttl (ms): a slot handed to another waiter that it does not confirm within this frees itself
--
-- Returns {1, ""} when the slot is held (a release may already have handed it over), else {0, queue entry}.
-- Order: while anyone waits, a free slot goes to the next waiter in fair order, never to a newcomer: first the
-- old FIFO, then class high, normal, low; within a class the tenant with the lowest counter; FIFO within a tenant.

local leases_key, legacy_key, max_key, line_key = KEYS[1], KEYS[2], KEYS[3], KEYS[7]
local lease_id, max_in_flight, lease_ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local wait_timeout, entry, name_prefix = tonumber(ARGV[4]), ARGV[5], ARGV[6]
local class, tenant, weight, handoff_ttl = ARGV[7], ARGV[8], ARGV[9], tonumber(ARGV[10])
local tenants_key = KEYS[({high = 4, normal = 5, low = 6})[class]]

local now = now_ms()

redis.call('SET', max_key, max_in_flight, 'PX', lease_ttl)
redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', now)

local function hold()
  redis.call('ZADD', leases_key, now + lease_ttl, lease_id)
  redis.call('PEXPIRE', leases_key, lease_ttl)
  return {1, ''}
end

-- Handed over by a release while we were waiting: confirm it with the full lease ttl.
if redis.call('ZSCORE', leases_key, lease_id) then return hold() end

local keep_ms = wait_timeout + lease_ttl
if entry == '' then
  if redis.call('ZCARD', leases_key) < max_in_flight
      and redis.call('EXISTS', legacy_key, KEYS[4], KEYS[5], KEYS[6]) == 0 then
    return hold()
  end
  entry = lease_id .. '|' .. (now + wait_timeout) .. '|' .. weight
  if not redis.call('ZSCORE', tenants_key, tenant) then
    local lowest = redis.call('ZRANGE', tenants_key, 0, 0, 'WITHSCORES')
    redis.call('ZADD', tenants_key, lowest[2] or 0, tenant)
  end
  redis.call('RPUSH', line_key, entry)
elseif redis.call('LLEN', line_key) > 0 and not redis.call('ZSCORE', tenants_key, tenant) then
  -- The class's set expired while this line lived on (only after an outage longer than keep_ms): rejoin it.
  local lowest = redis.call('ZRANGE', tenants_key, 0, 0, 'WITHSCORES')
  redis.call('ZADD', tenants_key, lowest[2] or 0, tenant)
end
redis.call('PEXPIRE', line_key, keep_ms)
redis.call('PEXPIRE', tenants_key, keep_ms)

-- A slot may be free with waiters in line (a holder's lease expired, max_in_flight was raised, or a gateway of
-- the previous version released without serving the lines): hand it out in fair order, this waiter included.
if redis.call('ZCARD', leases_key) < max_in_flight then
  hand_off(now, name_prefix, handoff_ttl, lease_id)
  if redis.call('ZSCORE', leases_key, lease_id) then return hold() end
end
return {0, entry}
