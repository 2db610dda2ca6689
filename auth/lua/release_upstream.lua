-- release_upstream: give back an upstream slot (or withdraw from a tenant's line) and hand free slots to the next
-- waiters in fair order, waking each through its own list so that nobody polls.
--
-- KEYS[1]  ug:{up:<d>}:leases               zset    in-flight leases: member lease id, score expiry (ms)
-- KEYS[2]  ug:{up:<d>}:queue                list    waiters of gateways before the fair queue: "<lease id>|<deadline
--                                                    ms>" (served first)
-- KEYS[3]  ug:{up:<d>}:max                  string  max_in_flight
-- KEYS[4]  ug:{up:<d>}:tenants:high         zset    tenants with waiters in the class, scored by virtual counter
-- KEYS[5]  ug:{up:<d>}:tenants:normal
-- KEYS[6]  ug:{up:<d>}:tenants:low
-- KEYS[7]  ug:{up:<d>}:queue:<class>:<tenant>  list  the withdrawing waiter's line (any of the deployment's names
--                                                    when ARGV[2] is "")
-- ARGV[1]  lease id being released (its slot, if held, is freed)
-- ARGV[2]  its queue entry, when a waiter gives up ("" otherwise)
-- ARGV[3]  the deployment's name prefix "ug:{up:<d>}:" (tenants' lines and wake lists "<prefix>wake:<lease id>"
--          share its slot)
-- ARGV[4]  hand-off ttl (ms): a handed-over slot not confirmed by its waiter within this frees itself
-- ARGV[5]  the withdrawing waiter's priority class: high | normal | low
-- ARGV[6]  the withdrawing waiter's tenant
--
-- Returns the number of waiters handed a slot.

local leases_key, legacy_key, max_key, line_key = KEYS[1], KEYS[2], KEYS[3], KEYS[7]
local lease_id, entry, name_prefix, handoff_ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local class, tenant = ARGV[5], ARGV[6]
local tenants_key = KEYS[({high = 4, normal = 5, low = 6})[class]]

local now = now_ms()

redis.call('ZREM', leases_key, lease_id)
if entry ~= '' then
  redis.call('LREM', line_key, 1, entry)
  if redis.call('LLEN', line_key) == 0 then redis.call('ZREM', tenants_key, tenant) end
end
redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', now)
return hand_off(now, name_prefix, handoff_ttl, '')
