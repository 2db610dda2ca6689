-- admit_request: verify a key and apply all of its limits atomically, in the one round trip of the hot path; or
-- (ARGV[1] empty) apply a team's limits, which are the same, to a request of one of its keys.
--
-- KEYS[1]  ug:{id}:key       hash   the key record (a team's: ug:{team:<id>}:team, and every name below under
--                                   that tag)
-- KEYS[2]  ug:{id}:rpm       zset   request log: member request id, score admit time (ms)
-- KEYS[3]  ug:{id}:tpm       zset   token log: member "<request id>|<tokens>", score reservation time (ms)
-- KEYS[4]  ug:{id}:tpm_sum   string tokens currently in KEYS[3]
-- KEYS[5]  ug:{id}:leases    zset   concurrency leases: member request id, score expiry (ms)
-- KEYS[6]  ug:{id}:holds     zset   budget reservations of requests in flight: member
--                                   "<request id>|<tokens>|<micros>", score expiry (ms)
-- KEYS[7]  ug:{id}:holds_sum string what KEYS[6] holds in all: "|<tokens>|<micros>" (kept by every script that
--                                   adds or removes a hold, so admission reads one value instead of summing
--                                   every request in flight: a team's holds are all its keys' requests)
-- ARGV[1]  hex SHA-256 of the presented secret (must equal the record's key_hash: a rotated key stops here); ""
--          for a team (its record has no secret, no revocation and no expiry, so those checks pass by themselves)
-- ARGV[2]  model id
-- ARGV[3]  estimated tokens to reserve (prompt estimate + max_tokens)
-- ARGV[4]  request id (rate-log member, lease member, settle marker)
-- ARGV[5]  lease ttl (ms)
-- ARGV[6]  rate window (ms; 60000 for per-minute limits)
-- ARGV[7]  the caller's cached record version ("" when it has none)
-- ARGV[8]  worst-case tokens for the budget reservation (a prompt bound that never undercounts + every output)
-- ARGV[9], ARGV[10] ..  pairs: model id, worst-case cost (micros) if served by it: the requested model first,
--          then its fallbacks. The reservation is the highest among the models the key may use.
--
-- Returns {status, version, record, rpm_limit, rpm_remaining, rpm_reset_ms, tpm_limit, tpm_remaining,
--          tpm_reset_ms, retry_after_ms, leases_remaining, budget_spent, budget_limit, budget_unit,
--          budget_held, budget_needed, reserved_micros}
--   status: "ok" | "invalid_api_key" | "team_not_found" (a team's record is gone) | "key_revoked" | "key_expired" | "model_not_allowed" | "budget_exceeded"
--           | "concurrency_limit_exceeded" | "rate_limit_exceeded" | "tokens_limit_exceeded"
--   record: the record as a flat HGETALL list when ARGV[7] differs from its version, else {} (cache refresh)
--   limits are -1 when the key has none; remaining counts are after this request (leases_remaining: concurrency
--   slots still free, -1 without a concurrency limit); all times in ms. A rejection reports the counts the
--   script got to (a remaining count is -1 where it did not: for TPM on "rate_limit_exceeded", for both on the
--   earlier checks), and the reset of the exceeded limit is its retry_after_ms.
--   budget_*: on "budget_exceeded", what was spent in the budget's period and its limit, in budget_unit
--   ("tokens", or "micros": integer micro-units of the price currency); 0, 0, "" otherwise. budget_held: what
--   requests in flight hold of it, budget_needed: this request's reservation (same unit). reserved_micros: on
--   "ok", the cost this request holds (0 when the key has no budget; the settle removes its hold with it).
--
-- Budgets are hard by reservation: a request is admitted only when spent + held by requests in flight + its own
-- worst case fits the budget. A hold expires after the lease ttl (a gateway that died never settles it), and
-- expired holds are dropped at the next admission of a budgeted key.
--
-- Algorithm: sliding-window log for RPM and TPM. It is exact: no rolling window of ARGV[6] ms ever holds more
-- than the limit, so there is no 2x burst at a fixed-window edge. GCRA would also be exact for the rate but
-- lets `burst + rate` through in the first window when burst = limit (or refuses OpenAI-style bursts when it is
-- small). The log costs one zset entry per request in the window, which per-minute limits keep small; the token
-- log keeps a running sum so admission does not re-add the window.

local record_key, rpm_key, tpm_key, tpm_sum_key, leases_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local key_hash, model, estimate, request_id = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local lease_ttl, window, cached_version = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local holds_key, held_key, budget_tokens = KEYS[6], KEYS[7], tonumber(ARGV[8]) or 0

local fields = redis.call('HMGET', record_key, 'key_hash', 'revoked', 'expires_at', 'models', 'rpm', 'tpm',
  'max_concurrent', 'token_budget', 'budget_period', 'period_key', 'period_spent', 'tokens_spent', 'version',
  'budget_micros', 'period_spend_micros', 'spend_micros', 'id')
if key_hash == '' then
  if not fields[17] then return {'team_not_found', 0, {}, -1, -1, 0, -1, -1, 0, 0, -1, 0, 0, '', 0, 0, 0} end
elseif not fields[1] or fields[1] ~= key_hash then
  return {'invalid_api_key', 0, {}, -1, -1, 0, -1, -1, 0, 0, -1, 0, 0, '', 0, 0, 0}
end

local function limit_of(value)
  local n = tonumber(value)
  if n == nil or n < 0 then return -1 end
  return n
end

local now = now_ms()
local version = tonumber(fields[13]) or 0
local record = {}
if cached_version ~= tostring(version) then
  record = redis.call('HGETALL', record_key)
end
local rpm, tpm, max_concurrent = limit_of(fields[5]), limit_of(fields[6]), limit_of(fields[7])
local budget, budget_micros = limit_of(fields[8]), limit_of(fields[14])

local function reject(status, retry_after, budget_spent, budget_limit, budget_unit, held, needed)
  return {status, version, record, rpm, -1, 0, tpm, -1, 0, retry_after, -1, budget_spent or 0, budget_limit or 0,
    budget_unit or '', held or 0, needed or 0, 0}
end

-- A token count from a log member "<request id>|<tokens>" (0 for anything unreadable, never an error).
local function member_tokens(member)
  return tonumber(string.match(member, '|([^|]*)$')) or 0
end

-- The tokens and micros of a hold "<request id>|<tokens>|<micros>" (0 for anything unreadable).
local function hold_of(member)
  local tokens, micros = string.match(member, '|([^|]*)|([^|]*)$')
  return tonumber(tokens) or 0, tonumber(micros) or 0
end

if fields[2] == '1' then return reject('key_revoked', 0) end
local expires_at = tonumber(fields[3])
if expires_at and expires_at <= now then return reject('key_expired', 0) end

-- Model allowlist: exact ids or glob patterns with * and ? (the admin API refuses other glob syntax, so this
-- matcher and Python's fnmatch agree).
local models = cjson.decode(fields[4] or '[]')
local function may_use(id)
  if #models == 0 then return true end
  for _, pattern in ipairs(models) do
    if pattern == id then return true end
    local lua_pattern = pattern:gsub('[%^%$%(%)%%%.%[%]%+%-]', '%%%0'):gsub('%*', '.*'):gsub('%?', '.')
    if string.match(id, '^' .. lua_pattern .. '$') then return true end
  end
  return false
end
if not may_use(model) then return reject('model_not_allowed', 0) end

-- Budgets (tokens and spend share one period): refuse unless spent + held by requests in flight + this
-- request's worst case fits. The cost is the highest among the models the key may be served by.
local hold_member = nil
local hold_micros = 0
local held, held_micros = 0, 0  -- what requests in flight hold (read when the key has a budget)
if budget >= 0 or budget_micros >= 0 then
  local period, period_left = period_of(fields[9] or 'total', now)
  local spent, spent_micros
  if period == '' then
    spent, spent_micros = tonumber(fields[12]) or 0, tonumber(fields[16]) or 0
  elseif fields[10] == period then
    spent, spent_micros = tonumber(fields[11]) or 0, tonumber(fields[15]) or 0
  else
    spent, spent_micros = 0, 0
  end
  for i = 9, #ARGV - 1, 2 do
    local micros = tonumber(ARGV[i + 1]) or 0
    if micros > hold_micros and (i == 9 or may_use(ARGV[i])) then hold_micros = micros end
  end
  -- What requests in flight hold: their running sum, less the holds that expired (dropped now). A sum that is
  -- missing while holds exist (lost, or never written) is rebuilt from the holds, once.
  local sum = redis.call('GET', held_key)
  local stored, stored_micros = nil, nil
  if sum then stored, stored_micros = hold_of(sum) end
  held, held_micros = stored or 0, stored_micros or 0
  if not sum then
    for _, member in ipairs(redis.call('ZRANGE', holds_key, 0, -1)) do
      local tokens, micros = hold_of(member)
      held, held_micros = held + tokens, held_micros + micros
    end
  end
  local expired = redis.call('ZRANGEBYSCORE', holds_key, '-inf', now)
  if #expired > 0 then
    for _, member in ipairs(expired) do
      local tokens, micros = hold_of(member)
      held, held_micros = held - tokens, held_micros - micros
    end
    redis.call('ZREMRANGEBYSCORE', holds_key, '-inf', now)
  end
  held, held_micros = math.max(held, 0), math.max(held_micros, 0)
  if (stored or 0) ~= held or (stored_micros or 0) ~= held_micros then  -- rare: holds expired, or a rebuild
    local ttl = redis.call('PTTL', holds_key)
    if ttl == -2 then  -- no hold left: nothing is held
      redis.call('DEL', held_key)
    elseif ttl > 0 then
      redis.call('SET', held_key, '|' .. string.format('%d', held) .. '|' .. string.format('%d', held_micros),
        'PX', ttl)
    end
  end
  -- A budget already reached refuses even a request that holds nothing (an unpriced model costs 0).
  if budget >= 0 and (spent >= budget or spent + held + budget_tokens > budget) then
    return reject('budget_exceeded', period_left, spent, budget, 'tokens', held, budget_tokens)
  end
  local over_micros = spent_micros + held_micros + hold_micros > budget_micros
  if budget_micros >= 0 and (spent_micros >= budget_micros or over_micros) then
    return reject('budget_exceeded', period_left, spent_micros, budget_micros, 'micros', held_micros, hold_micros)
  end
  hold_member = request_id .. '|' .. string.format('%d', budget_tokens) .. '|' .. string.format('%d', hold_micros)
end

-- Concurrency: expired leases belong to crashed or stuck requests. They only matter at the limit, so they are
-- dropped (and the leases counted again) only then: one call instead of two on the usual path.
local num_leases = 0
if max_concurrent >= 0 then
  num_leases = redis.call('ZCARD', leases_key)
  if num_leases >= max_concurrent then
    redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', now)
    num_leases = redis.call('ZCARD', leases_key)
    if num_leases >= max_concurrent then
      return reject('concurrency_limit_exceeded', 1000)
    end
  end
end

local cutoff = now - window
local num_requests, rpm_reset = 0, 0
if rpm >= 0 then
  redis.call('ZREMRANGEBYSCORE', rpm_key, '-inf', cutoff)
  num_requests = redis.call('ZCARD', rpm_key)
  if num_requests >= rpm then
    -- The (n - rpm + 1)-th oldest entry must leave the window before one more request fits.
    local retry_after = window
    if rpm > 0 then
      local entry = redis.call('ZRANGE', rpm_key, num_requests - rpm, num_requests - rpm, 'WITHSCORES')
      retry_after = tonumber(entry[2]) + window - now
    end
    return {'rate_limit_exceeded', version, record, rpm, 0, retry_after, tpm, -1, 0, retry_after, -1, 0, 0, '', 0,
      0, 0}
  end
end

local num_tokens, tpm_reset = 0, 0
if tpm >= 0 then
  local expired = redis.call('ZRANGEBYSCORE', tpm_key, '-inf', cutoff)
  if #expired > 0 then
    local num_expired = 0
    for _, member in ipairs(expired) do
      num_expired = num_expired + member_tokens(member)
    end
    redis.call('ZREMRANGEBYSCORE', tpm_key, '-inf', cutoff)
    redis.call('DECRBY', tpm_sum_key, string.format('%d', num_expired))
  end
  num_tokens = tonumber(redis.call('GET', tpm_sum_key)) or 0
  if num_tokens + estimate > tpm then
    local retry_after = window
    local entries = redis.call('ZRANGE', tpm_key, 0, -1, 'WITHSCORES')
    -- A request that can never fit gets no retry hint; its reset is when the oldest reservation leaves.
    local tpm_reset_now = 0
    if #entries > 0 then tpm_reset_now = tonumber(entries[2]) + window - now end
    if estimate <= tpm then
      local num_freed = 0
      for i = 1, #entries, 2 do
        num_freed = num_freed + member_tokens(entries[i])
        if num_tokens - num_freed + estimate <= tpm then
          retry_after = tonumber(entries[i + 1]) + window - now
          break
        end
      end
      tpm_reset_now = retry_after
    end
    local rpm_remaining_now, rpm_reset_now = -1, 0
    if rpm >= 0 then
      rpm_remaining_now = rpm - num_requests
      local oldest = redis.call('ZRANGE', rpm_key, 0, 0, 'WITHSCORES')
      if #oldest > 0 then rpm_reset_now = tonumber(oldest[2]) + window - now end
    end
    return {'tokens_limit_exceeded', version, record, rpm, rpm_remaining_now, rpm_reset_now, tpm,
      math.max(tpm - num_tokens, 0), tpm_reset_now, retry_after, -1, 0, 0, '', 0, 0, 0}
  end
end

-- Every check passed: record the request, reserve its tokens, take a lease.
if rpm >= 0 then
  redis.call('ZADD', rpm_key, now, request_id)
  redis.call('PEXPIRE', rpm_key, window)
  num_requests = num_requests + 1
  local oldest = redis.call('ZRANGE', rpm_key, 0, 0, 'WITHSCORES')
  rpm_reset = tonumber(oldest[2]) + window - now
end
if tpm >= 0 then
  if estimate > 0 then
    redis.call('ZADD', tpm_key, now, request_id .. '|' .. string.format('%d', estimate))
    redis.call('INCRBY', tpm_sum_key, string.format('%d', estimate))
  end
  num_tokens = num_tokens + estimate
  redis.call('PEXPIRE', tpm_key, window)
  redis.call('PEXPIRE', tpm_sum_key, window)
  local oldest_tokens = redis.call('ZRANGE', tpm_key, 0, 0, 'WITHSCORES')
  if #oldest_tokens > 0 then tpm_reset = tonumber(oldest_tokens[2]) + window - now end
end
if max_concurrent >= 0 then
  redis.call('ZADD', leases_key, now + lease_ttl, request_id)
  redis.call('PEXPIRE', leases_key, lease_ttl)
end
if hold_member then
  redis.call('ZADD', holds_key, now + lease_ttl, hold_member)
  redis.call('PEXPIRE', holds_key, lease_ttl)
  -- The sum lives exactly as long as the holds (every hold expires by then).
  redis.call('SET', held_key, '|' .. string.format('%d', held + budget_tokens) .. '|' ..
    string.format('%d', held_micros + hold_micros), 'PX', lease_ttl)
end

local rpm_remaining, tpm_remaining = -1, -1
if rpm >= 0 then rpm_remaining = rpm - num_requests end
if tpm >= 0 then tpm_remaining = math.max(tpm - num_tokens, 0) end
local leases_remaining = -1
if max_concurrent >= 0 then leases_remaining = max_concurrent - num_leases - 1 end
return {'ok', version, record, rpm, rpm_remaining, rpm_reset, tpm, tpm_remaining, tpm_reset, 0, leases_remaining,
  0, 0, '', 0, 0, hold_micros}
