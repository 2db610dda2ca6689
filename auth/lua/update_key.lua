-- update_key: change fields of an existing key record and bump its version (cached copies compare versions).
--
-- KEYS[1]  ug:{id}:key  hash  the key record
-- ARGV     field, value, field, value, ... (empty value = unset limit / no expiry)
--
-- Returns the new version, or 0 when the record does not exist (it is never created here).

local record_key = KEYS[1]
if redis.call('EXISTS', record_key) == 0 then return 0 end
if #ARGV > 0 then redis.call('HSET', record_key, unpack(ARGV)) end
redis.call('HSET', record_key, 'updated_at', now_ms())
return redis.call('HINCRBY', record_key, 'version', 1)
