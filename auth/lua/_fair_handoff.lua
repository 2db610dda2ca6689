-- Shared prelude of acquire_upstream.lua and release_upstream.lua (auth/scripts.py prepends it to both): handing a
-- deployment's free max_in_flight slots to its waiters in fair order. Both scripts pass their keys in the same
-- places, which these functions read:
--
-- KEYS[1]  ug:{up:<d>}:leases      zset  in-flight leases: member lease id, score expiry (ms)
-- KEYS[2]  ug:{up:<d>}:queue       list  waiters of gateways before the fair queue, served first
-- KEYS[3]  ug:{up:<d>}:max         string max_in_flight
-- KEYS[4..6] ug:{up:<d>}:tenants:<high|normal|low>  zset  tenants with waiters, scored by their virtual counter
-- A tenant's line is `<name_prefix>queue:<class>:<tenant>`, a waiter's wake-up list `<name_prefix>wake:<lease id>`.

-- The next live waiter in fair order, taken out of its line (expired waiters are dropped on the way), or nil.
local function next_waiter(now, name_prefix)
  while true do
    local head = redis.call('LPOP', KEYS[2])
    if not head then break end
    local waiter, deadline = string.match(head, '^(.*)|(%d+)$')
    if deadline and tonumber(deadline) >= now then return waiter end
  end
  for i, name in ipairs({'high', 'normal', 'low'}) do
    local class_key = KEYS[3 + i]
    while true do
      local top = redis.call('ZRANGE', class_key, 0, 0, 'WITHSCORES')
      if #top == 0 then break end
      local line = name_prefix .. 'queue:' .. name .. ':' .. top[1]
      while true do
        local head = redis.call('LPOP', line)
        if not head then break end
        local waiter, deadline, served_weight = string.match(head, '^(.*)|(%d+)|([^|]*)$')
        if deadline and tonumber(deadline) >= now then
          if redis.call('LLEN', line) == 0 then
            redis.call('ZREM', class_key, top[1])  -- idle tenants leave: no entry, no banked credit
          else
            redis.call('ZADD', class_key, tonumber(top[2]) + 1 / (tonumber(served_weight) or 1), top[1])
          end
          return waiter
        end
      end
      redis.call('ZREM', class_key, top[1])
    end
  end
  return nil
end

-- Hand every free slot to the next waiters, waking each through its own list (`except` is the caller: not woken).
local function hand_off(now, name_prefix, handoff_ttl, except)
  local max_slots = tonumber(redis.call('GET', KEYS[3]) or '0')
  local num_handed = 0
  while redis.call('ZCARD', KEYS[1]) < max_slots do
    local waiter = next_waiter(now, name_prefix)
    if not waiter then break end
    redis.call('ZADD', KEYS[1], now + handoff_ttl, waiter)
    if waiter ~= except then
      local wake_key = name_prefix .. 'wake:' .. waiter
      redis.call('RPUSH', wake_key, '1')
      redis.call('PEXPIRE', wake_key, handoff_ttl)
    end
    num_handed = num_handed + 1
  end
  return num_handed
end
