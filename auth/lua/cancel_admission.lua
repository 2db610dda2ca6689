-- cancel_admission: undo what admit_request took for one request that will not run, because the other half of
-- its admission refused it (a key admitted whose team was not, or the reverse; docs/keys-and-limits.md, "Teams").
--
-- KEYS[1]  ug:{id}:rpm       zset    request log (member request id)
-- KEYS[2]  ug:{id}:tpm       zset    token log (member "<request id>|<tokens>")
-- KEYS[3]  ug:{id}:tpm_sum   string  tokens in KEYS[2]
-- KEYS[4]  ug:{id}:leases    zset    concurrency leases (member request id)
-- KEYS[5]  ug:{id}:holds     zset    budget holds (member "<request id>|<tokens>|<micros>")
-- KEYS[6]  ug:{id}:holds_sum string  what KEYS[5] holds in all ("|<tokens>|<micros>"; admit_request.lua)
-- ARGV[1]  request id
-- ARGV[2]  tokens reserved at admission (the token log member's count)
-- ARGV[3]  the budget hold's member
--
-- Returns how many entries it removed (0: the admission had taken nothing, or was cancelled already). Every
-- removal is of this request's own members, so a repeated call changes nothing.

local rpm_key, tpm_key, tpm_sum_key, leases_key, holds_key, held_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6]
local request_id, reserved, hold_member = ARGV[1], tonumber(ARGV[2]) or 0, ARGV[3]

local removed = redis.call('ZREM', rpm_key, request_id) + redis.call('ZREM', leases_key, request_id)
if redis.call('ZREM', holds_key, hold_member) == 1 then
  removed = removed + 1
  local sum = redis.call('GET', held_key)  -- "|<tokens>|<micros>"; missing: rebuilt at the next admission
  if sum then
    local tokens, micros = string.match(hold_member, '|([^|]*)|([^|]*)$')
    local held, held_micros = string.match(sum, '|([^|]*)|([^|]*)$')
    local left = (tonumber(held) or 0) - (tonumber(tokens) or 0)
    local left_micros = (tonumber(held_micros) or 0) - (tonumber(micros) or 0)
    if left < 0 or left_micros < 0 then
      redis.call('DEL', held_key)  -- it had drifted: rebuilt at the next admission
    else
      redis.call('SET', held_key, '|' .. string.format('%d', left) .. '|' .. string.format('%d', left_micros),
        'KEEPTTL')
    end
  end
end
if redis.call('ZREM', tpm_key, request_id .. '|' .. string.format('%d', reserved)) == 1 then
  removed = removed + 1
  if redis.call('DECRBY', tpm_sum_key, string.format('%d', reserved)) < 0 then redis.call('SET', tpm_sum_key, 0) end
  -- The sum lives exactly as long as its log (gone with the last entry: then it is 0).
  local ttl = redis.call('PTTL', tpm_key)
  if ttl > 0 then redis.call('PEXPIRE', tpm_sum_key, ttl) elseif ttl == -2 then redis.call('DEL', tpm_sum_key) end
end
return removed
