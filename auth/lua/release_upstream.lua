-- release_upstream: give back an upstream slot (or withdraw from the queue) and hand free slots to the oldest
-- waiters, waking each through its own list so that nobody polls.
--
-- KEYS[1]  ug:{up:<d>}:leases  zset    in-flight leases: member lease id, score expiry (ms)
-- KEYS[2]  ug:{up:<d>}:queue   list    waiters "<lease id>|<deadline ms>"
-- KEYS[3]  ug:{up:<d>}:max     string  max_in_flight
-- ARGV[1]  lease id being released (its slot, if held, is freed)
-- ARGV[2]  its queue entry, when a waiter gives up ("" otherwise)
-- ARGV[3]  the deployment's name prefix "ug:{up:<d>}:" (wake lists "<prefix>wake:<lease id>" share its slot)
-- ARGV[4]  hand-off ttl (ms): a handed-over slot not confirmed by its waiter within this frees itself
--
-- Returns the number of waiters handed a slot.

local leases_key, queue_key, max_key = KEYS[1], KEYS[2], KEYS[3]
local lease_id, entry, name_prefix, handoff_ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])

local now = now_ms()
redis.call('ZREM', leases_key, lease_id)
if entry ~= '' then redis.call('LREM', queue_key, 1, entry) end
redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', now)

local max_in_flight = tonumber(redis.call('GET', max_key) or '0')
local num_handed = 0
while redis.call('ZCARD', leases_key) < max_in_flight do
  local head = redis.call('LPOP', queue_key)
  if not head then break end
  local waiter, deadline = string.match(head, '^(.*)|(%d+)$')
  if tonumber(deadline) >= now then
    redis.call('ZADD', leases_key, now + handoff_ttl, waiter)
    local wake_key = name_prefix .. 'wake:' .. waiter
    redis.call('RPUSH', wake_key, '1')
    redis.call('PEXPIRE', wake_key, handoff_ttl)
    num_handed = num_handed + 1
  end
end
return num_handed
