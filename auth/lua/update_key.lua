-- update_key: change fields of an existing key record and bump its version (cached copies compare versions).
--
-- KEYS[1]  ug:{id}:key  hash  the key record
-- ARGV[1]  the key's name prefix "ug:{id}:" (its per-day usage hashes "ug:{id}:usage:<YYYY-MM-DD>" are built from
--          it, so they share the hash tag and slot of KEYS[1])
-- ARGV[2..] field, value, field, value, ... (empty value = unset limit / no expiry)
--
-- A change of budget_period to "day" or "month" recounts the new period's spend (tokens and micro-units) from the
-- per-day usage hashes, so a key does not start the new kind of period at 0 with what it already spent today or
-- this month forgotten. ("total" reads the lifetime counters and needs nothing.)
--
-- Returns the new version, or 0 when the record does not exist (it is never created here).

local record_key, name_prefix = KEYS[1], ARGV[1]
if redis.call('EXISTS', record_key) == 0 then return 0 end
local old_period = redis.call('HGET', record_key, 'budget_period') or 'total'
if #ARGV > 1 then redis.call('HSET', record_key, unpack(ARGV, 2)) end
local new_period = redis.call('HGET', record_key, 'budget_period') or 'total'
local now = now_ms()

if new_period ~= old_period and new_period ~= 'total' then
  local today = math.floor(now / 86400000)
  local first = today
  if new_period == 'month' then
    local y, m = civil_from_days(today)
    first = days_from_civil(y, m, 1)
  end
  local tokens, micros = 0, 0
  for day = first, today do
    local y, m, d = civil_from_days(day)
    local usage = redis.call('HGETALL', name_prefix .. 'usage:' .. string.format('%04d-%02d-%02d', y, m, d))
    for i = 1, #usage, 2 do
      local counter = string.match(usage[i], '|([%w_]+)$')
      local value = tonumber(usage[i + 1]) or 0
      if counter == 'prompt_tokens' or counter == 'completion_tokens' then
        tokens = tokens + value
      elseif counter == 'cost_micros' then
        micros = micros + value
      end
    end
  end
  local period = period_of(new_period, now)
  redis.call('HSET', record_key, 'period_key', period, 'period_spent', string.format('%d', tokens),
    'period_spend_micros', string.format('%d', micros))
end

redis.call('HSET', record_key, 'updated_at', now)
return redis.call('HINCRBY', record_key, 'version', 1)
