-- settle_request: after requests of one key end (success, error or disconnect), true up their token
-- reservations, release their concurrency leases and record usage and spend. The gateway batches the settles of
-- one key that end while a previous batch is on the wire (group commit), so the record, usage and calendar work
-- below runs once per batch, not once per request. Idempotent per request: settling a request again changes
-- nothing.
--
-- KEYS[1]  ug:{id}:key                 hash    the key record (lifetime counters, budget period)
-- KEYS[2]  ug:{id}:tpm                 zset    token log (member "<request id>|<tokens>")
-- KEYS[3]  ug:{id}:tpm_sum             string  tokens in KEYS[2]
-- KEYS[4]  ug:{id}:leases              zset    concurrency leases
-- KEYS[5]  ug:{id}:usage_total         hash    lifetime "<model>|<counter>"
-- KEYS[6]  ug:{id}:usage_days          zset    days with usage
-- KEYS[7]  ug:{id}:holds               zset    budget reservations of requests in flight
-- KEYS[8]  ug:{id}:holds_sum           string  what KEYS[7] holds in all ("|<tokens>|<micros>"; admit_request.lua)
-- KEYS[8+i] ug:{id}:settled:<request>  string  idempotency marker of the i-th request
-- ARGV[1]  the key's name prefix "ug:{id}:" (the per-day usage hash "ug:{id}:usage:<YYYY-MM-DD>" is built from it,
--          so it shares the hash tag and slot of KEYS[*])
-- ARGV[2]  rate window (ms)
-- ARGV[3]  marker ttl (ms)
-- ARGV[4]  usage retention (s) for per-day hashes
-- ARGV[5 + 9(i-1) ..]  per request i: request id, tokens reserved at admission, prompt tokens used,
--                      completion tokens used, model id, cost (integer micro-units of the price currency),
--                      1 when the model had a price (0: it cost 0 because none is configured), its budget hold's
--                      member in KEYS[7] (removed: the charge replaces it), 1 when the counts are an estimate
--                      (the upstream reported none; counted as "<model>|estimated_requests")
--
-- Returns one flag per request: 1 when this call settled it, 0 when it had already been settled (or, for a team's
-- state, when the team has been deleted since the admission: nothing is written, so no half record reappears).
--
-- Token log rules (the admission script reads them): a reservation still in the window is replaced by the real
-- figure (refund or charge the difference at the reservation's time); a charge above a reservation that already
-- left the window, or above a reservation that was never logged (the key had no TPM limit when it was admitted),
-- is logged now for its excess when the key has a TPM limit now. Counts are clamped to non-negative integers
-- below 2^50 and written as integers, so a Lua number never reaches a member as "1e+15".

local record_key, tpm_key, tpm_sum_key, leases_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local total_key, days_key, holds_key, held_key = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local name_prefix, window, marker_ttl, retention = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])

local MAX_COUNT = 1125899906842624  -- 2^50: exact in a Lua double, far above any real usage

local function count_of(value)
  local n = tonumber(value)
  if n == nil or n ~= n or n < 0 then return 0 end
  if n > MAX_COUNT then return MAX_COUNT end
  return math.floor(n)
end

local function limit_of(value)
  local n = tonumber(value)
  if n == nil or n < 0 then return -1 end
  return n
end

local function int(n) return string.format('%d', n) end

local now = now_ms()
local settled = {}
if string.find(name_prefix, '{team:', 1, true) and redis.call('EXISTS', record_key) == 0 then
  for i = 1, #KEYS - 8 do settled[i] = 0 end
  return settled
end
local tpm_limit = nil  -- read once, only when a charge lands after its reservation left the window
local tpm_delta, tpm_touched = 0, false
local sum_prompt, sum_completion, sum_cost, num_settled = 0, 0, 0, 0
local freed, freed_micros = 0, 0  -- the holds this call removed (their sums leave KEYS[8])
local by_model, models = {}, {}

for i = 1, #KEYS - 8 do
  local base = 5 + (i - 1) * 9
  local request_id, reserved = ARGV[base], count_of(ARGV[base + 1])
  local prompt_tokens, completion_tokens = count_of(ARGV[base + 2]), count_of(ARGV[base + 3])
  local model, cost, is_priced = ARGV[base + 4], count_of(ARGV[base + 5]), ARGV[base + 6] == '1'
  local is_estimated = ARGV[base + 8] == '1'
  if not redis.call('SET', KEYS[8 + i], '1', 'NX', 'PX', marker_ttl) then
    settled[i] = 0
  else
    settled[i] = 1
    local used = prompt_tokens + completion_tokens
    redis.call('ZREM', leases_key, request_id)
    if redis.call('ZREM', holds_key, ARGV[base + 7]) == 1 then  -- (an expired hold was dropped with its sum)
      local tokens, micros = string.match(ARGV[base + 7], '|([^|]*)|([^|]*)$')
      freed, freed_micros = freed + (tonumber(tokens) or 0), freed_micros + (tonumber(micros) or 0)
    end
    local reserved_member = request_id .. '|' .. int(reserved)
    local score = redis.call('ZSCORE', tpm_key, reserved_member)
    if score and tonumber(score) > now - window then
      redis.call('ZREM', tpm_key, reserved_member)
      if used > 0 then redis.call('ZADD', tpm_key, score, request_id .. '|' .. int(used)) end
      tpm_delta = tpm_delta + used - reserved
      tpm_touched = true
    elseif used > reserved then
      if tpm_limit == nil then tpm_limit = limit_of(redis.call('HGET', record_key, 'tpm')) end
      if tpm_limit >= 0 then
        local extra = used - reserved
        redis.call('ZADD', tpm_key, now, request_id .. ':extra|' .. int(extra))  -- never the reservation's member
        tpm_delta = tpm_delta + extra
        tpm_touched = true
      end
    end
    num_settled = num_settled + 1
    sum_prompt, sum_completion = sum_prompt + prompt_tokens, sum_completion + completion_tokens
    sum_cost = sum_cost + cost
    local counts = by_model[model]
    if counts == nil then
      counts = {0, 0, 0, 0, 0, 0}
      by_model[model] = counts
      models[#models + 1] = model
    end
    counts[1], counts[2], counts[3] = counts[1] + 1, counts[2] + prompt_tokens, counts[3] + completion_tokens
    counts[4] = counts[4] + cost
    if not is_priced then counts[5] = counts[5] + 1 end
    if is_estimated then counts[6] = counts[6] + 1 end
  end
end

if num_settled == 0 then return settled end

if freed > 0 or freed_micros > 0 then
  local sum = redis.call('GET', held_key)  -- "|<tokens>|<micros>"; missing: rebuilt at the next admission
  if sum then
    local tokens, micros = string.match(sum, '|([^|]*)|([^|]*)$')
    local left, left_micros = (tonumber(tokens) or 0) - freed, (tonumber(micros) or 0) - freed_micros
    if left < 0 or left_micros < 0 then
      redis.call('DEL', held_key)  -- it had drifted: rebuilt at the next admission
    else
      redis.call('SET', held_key, '|' .. int(left) .. '|' .. int(left_micros), 'KEEPTTL')
    end
  end
end

if tpm_touched then
  if tpm_delta ~= 0 then
    local num_tokens = redis.call('INCRBY', tpm_sum_key, int(tpm_delta))
    if num_tokens < 0 then redis.call('SET', tpm_sum_key, 0) end
  end
  -- The log and its sum always expire together, and never live without a TTL: every entry is at most `now`
  -- old, so one more window from now outlives all of them.
  redis.call('PEXPIRE', tpm_key, window)
  redis.call('PEXPIRE', tpm_sum_key, window)
end

-- Lifetime counters and the budget's current period live in the record itself.
local used = sum_prompt + sum_completion
redis.call('HINCRBY', record_key, 'num_requests', num_settled)
redis.call('HINCRBY', record_key, 'prompt_tokens', int(sum_prompt))
redis.call('HINCRBY', record_key, 'completion_tokens', int(sum_completion))
redis.call('HINCRBY', record_key, 'tokens_spent', int(used))
redis.call('HINCRBY', record_key, 'spend_micros', int(sum_cost))
local period_fields = redis.call('HMGET', record_key, 'budget_period', 'period_key')
local period = period_of(period_fields[1] or 'total', now)
if period ~= '' then
  if period_fields[2] == period then
    redis.call('HINCRBY', record_key, 'period_spent', int(used))
    redis.call('HINCRBY', record_key, 'period_spend_micros', int(sum_cost))
    redis.call('HSET', record_key, 'last_used_at', now)
  else
    redis.call('HSET', record_key, 'period_key', period, 'period_spent', int(used),
      'period_spend_micros', int(sum_cost), 'last_used_at', now)
  end
else
  redis.call('HSET', record_key, 'last_used_at', now)
end

local day = day_string(now)
local day_key = name_prefix .. 'usage:' .. day
for _, model in ipairs(models) do
  local counts = by_model[model]
  for _, target in ipairs({day_key, total_key}) do
    redis.call('HINCRBY', target, model .. '|requests', counts[1])
    redis.call('HINCRBY', target, model .. '|prompt_tokens', int(counts[2]))
    redis.call('HINCRBY', target, model .. '|completion_tokens', int(counts[3]))
    redis.call('HINCRBY', target, model .. '|cost_micros', int(counts[4]))
    if counts[5] > 0 then redis.call('HINCRBY', target, model .. '|unpriced_requests', counts[5]) end
    if counts[6] > 0 then redis.call('HINCRBY', target, model .. '|estimated_requests', counts[6]) end
  end
end
redis.call('EXPIRE', day_key, retention)
redis.call('ZADD', days_key, math.floor(now / 86400000), day)
return settled
