-- acquire_upstream: take one of a deployment's cluster-wide max_in_flight slots, or join its FIFO of waiters.
--
-- KEYS[1]  ug:{up:<d>}:leases  zset    in-flight leases: member lease id, score expiry (ms)
-- KEYS[2]  ug:{up:<d>}:queue   list    waiters "<lease id>|<deadline ms>", oldest first
-- KEYS[3]  ug:{up:<d>}:max     string  max_in_flight, kept for release_upstream's hand-off
-- ARGV[1]  lease id (also the waiter id)
-- ARGV[2]  max_in_flight
-- ARGV[3]  lease ttl (ms): a crashed holder's slot frees itself after this
-- ARGV[4]  wait timeout (ms): a queued waiter that has not come back by then is skipped
-- ARGV[5]  this waiter's queue entry from an earlier call ("" on the first call)
--
-- Returns {1, ""} when the slot is held (a release may already have handed it over), else {0, queue entry}.
-- Fairness: while anyone is queued, a free slot goes to the head of the queue, never to a newcomer.

local leases_key, queue_key, max_key = KEYS[1], KEYS[2], KEYS[3]
local lease_id, max_in_flight, lease_ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local wait_timeout, entry = tonumber(ARGV[4]), ARGV[5]

local now = now_ms()
redis.call('SET', max_key, max_in_flight, 'PX', lease_ttl)
redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', now)

local function hold()
  redis.call('ZADD', leases_key, now + lease_ttl, lease_id)
  redis.call('PEXPIRE', leases_key, lease_ttl)
  if entry ~= '' then redis.call('LREM', queue_key, 1, entry) end
  return {1, ''}
end

-- Handed over by a release while we were waiting: confirm it with the full lease ttl.
if redis.call('ZSCORE', leases_key, lease_id) then return hold() end

-- Waiters whose deadline passed gave up or crashed; they must not block the queue.
while true do
  local head = redis.call('LINDEX', queue_key, 0)
  if not head or tonumber(string.match(head, '|(%d+)$')) >= now then break end
  redis.call('LPOP', queue_key)
end

if redis.call('ZCARD', leases_key) < max_in_flight then
  local head = redis.call('LINDEX', queue_key, 0)
  if not head or head == entry then return hold() end
end

if entry == '' then
  entry = lease_id .. '|' .. (now + wait_timeout)
  redis.call('RPUSH', queue_key, entry)
end
redis.call('PEXPIRE', queue_key, wait_timeout + lease_ttl)
return {0, entry}
