-- settle_request: after a request ends (success, error or disconnect), true up its token reservation, release its
-- concurrency lease and record usage. Idempotent: a second call for the same request changes nothing.
--
-- KEYS[1]  ug:{id}:key                 hash    the key record (lifetime counters, budget period)
-- KEYS[2]  ug:{id}:tpm                 zset    token log (member "<request id>|<tokens>")
-- KEYS[3]  ug:{id}:tpm_sum             string  tokens in KEYS[2]
-- KEYS[4]  ug:{id}:leases              zset    concurrency leases
-- KEYS[5]  ug:{id}:usage_total         hash    lifetime "<model>|<counter>"
-- KEYS[6]  ug:{id}:usage_days          zset    days with usage
-- KEYS[7]  ug:{id}:settled:<request>   string  idempotency marker
-- ARGV[1]  request id
-- ARGV[2]  tokens reserved at admission
-- ARGV[3]  prompt tokens used
-- ARGV[4]  completion tokens used
-- ARGV[5]  model id
-- ARGV[6]  the key's name prefix "ug:{id}:" (the per-day usage hash "ug:{id}:usage:<YYYY-MM-DD>" is built from it,
--          so it shares the hash tag and slot of KEYS[*])
-- ARGV[7]  rate window (ms)
-- ARGV[8]  marker ttl (ms)
-- ARGV[9]  usage retention (s) for per-day hashes
--
-- Returns 1 when this call settled the request, 0 when it had already been settled.

local record_key, tpm_key, tpm_sum_key, leases_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local total_key, days_key, marker_key = KEYS[5], KEYS[6], KEYS[7]
local request_id, reserved = ARGV[1], tonumber(ARGV[2])
local prompt_tokens, completion_tokens, model = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local name_prefix, window, marker_ttl, retention = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])

if not redis.call('SET', marker_key, '1', 'NX', 'PX', marker_ttl) then
  return 0
end

local now = now_ms()
local used = prompt_tokens + completion_tokens
redis.call('ZREM', leases_key, request_id)

-- Token log: replace the reservation with the real figure while it is still in the window (refund or charge
-- the difference); a charge above a reservation that already left the window is logged now.
local reserved_member = request_id .. '|' .. reserved
local score = redis.call('ZSCORE', tpm_key, reserved_member)
if score and tonumber(score) > now - window then
  redis.call('ZREM', tpm_key, reserved_member)
  if used > 0 then redis.call('ZADD', tpm_key, score, request_id .. '|' .. used) end
  local num_tokens = redis.call('INCRBY', tpm_sum_key, used - reserved)
  if num_tokens < 0 then redis.call('SET', tpm_sum_key, 0, 'KEEPTTL') end
elseif used > reserved and tonumber(redis.call('HGET', record_key, 'tpm') or '-1') >= 0 then
  local extra = used - reserved
  redis.call('ZADD', tpm_key, now, request_id .. '|' .. extra)
  redis.call('INCRBY', tpm_sum_key, extra)
  redis.call('PEXPIRE', tpm_key, window)
  redis.call('PEXPIRE', tpm_sum_key, window)
end

-- Lifetime counters and the budget's current period live in the record itself.
redis.call('HINCRBY', record_key, 'num_requests', 1)
redis.call('HINCRBY', record_key, 'prompt_tokens', prompt_tokens)
redis.call('HINCRBY', record_key, 'completion_tokens', completion_tokens)
redis.call('HINCRBY', record_key, 'tokens_spent', used)
redis.call('HSET', record_key, 'last_used_at', now)
local period = period_of(redis.call('HGET', record_key, 'budget_period') or 'total', now)
if period ~= '' then
  if redis.call('HGET', record_key, 'period_key') == period then
    redis.call('HINCRBY', record_key, 'period_spent', used)
  else
    redis.call('HSET', record_key, 'period_key', period, 'period_spent', used)
  end
end

local day = day_string(now)
local day_key = name_prefix .. 'usage:' .. day
for _, target in ipairs({day_key, total_key}) do
  redis.call('HINCRBY', target, model .. '|requests', 1)
  redis.call('HINCRBY', target, model .. '|prompt_tokens', prompt_tokens)
  redis.call('HINCRBY', target, model .. '|completion_tokens', completion_tokens)
end
redis.call('EXPIRE', day_key, retention)
redis.call('ZADD', days_key, math.floor(now / 86400000), day)
return 1
